"""Peak memory per device of one model-stage: what stays resident between its runs and what it needs
only while it runs.

- resident (parked while other model-stages run on the same devices): the weights, stored in the
  compute dtype for gen/infer (gen twice: the unit's, the engine's per-layer copy); for train the
  parameters in their stored dtype plus Adam's float32 m and v, 1/dp of them with
  ``Workload.shard_optimizer`` (and a float32 master copy when parameters are not float32). kv heads
  count once per stored copy.
- working (only while the stage runs): gen: the KV cache of its decode slots at the longest context,
  slot logits, one prefill; infer: one call's hidden states, one layer's activations, attention scores
  when materialised, the output head's float32 working set; train: gradients (twice with accumulation),
  the stored activations of a call (remat keeps only layer inputs plus one layer recomputed), the head's
  working set in the backward; plus the hardware's workspace. The head runs on a row's response positions
  (every position of a packed row) over ``Workload.vocab_chunk``-wide vocabulary chunks
  (:mod:`nereus_jax.vocab_chunks`): :func:`head_bytes`. With pp > 1 the schedule that runs
  (``Workload.pipeline_schedule``) sets the activations: GPipe, differentiated through, keeps every tick's
  (m micro-batches and pp - 1 bubble ticks) and runs the head over the call (rows split over pp when they
  divide); 1F1B keeps min(m, 2 pp - 1) stashed stage inputs and one micro-batch's activations (its backward
  recomputes it), and the last stage runs the head one micro-batch at a time.

Expert parallelism (ep > 1, scoring and training of a mixture of experts): a device keeps 1/ep of the
routed experts (and of their gradients and Adam state); its calls' activations are those of ep = 1, since
``sharding.experts`` keeps them whole on every device of the group and sizes the experts' buffers by all of
the call's token-expert pairs (static shapes), whatever share of them the device computes.

A device's peak is the resident state of every model-stage placed on it plus the largest working set
among them (``device_peak_bytes``); the planner keeps that under capacity x (1 - headroom).

LoRA's frozen base: units that hold it identically on a device (the same replica, layout, dtype, device
memory) share one copy of its buffers (``nereus_jax.elastic.shared_base``), so a device holds the largest of
their bases once, not each. :func:`frozen_base_bytes` and :func:`share_group` say how big a unit's base is
and which units may share it; ``Topology.device_bytes`` subtracts the copies not held.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from nereus_jax.config import ModelConfig
from nereus_jax.elastic.costs import counts
from nereus_jax.elastic.costs.stage import (
    StageChoice,
    head_split,
    one_f_one_b,
    pipeline_microbatches,
    stash_microbatches,
)
from nereus_jax.elastic.hardware import Hardware
from nereus_jax.elastic.workload import Workload
from nereus_jax.model_stage import split_stage, stage_decl, stage_head
from nereus_jax.vocab_chunks import chunk_width

# float32 [positions, vocab columns] arrays the lm head holds at once (XLA:CPU buffer assignment of the job's
# programs, compiled memory_analysis: tools/bench_vocab.py): whole logits: the scoring forward 1 (log-softmax
# and the gather fuse into it), the training step 3 (logits, their softmax, the gradient); over chunks: 2 in
# a scoring forward (a chunk's logits, their exponent), 3 in the backward (of the recomputed logits, their
# probabilities, the cotangent and its transposed copy for the kernel's gradient, the job's train programs at
# issue 32's two shapes hold 3 and 2 at their peak; bench_vocab's one-device step about 3.6: docs/results.md).
_HEAD_ARRAYS = {("infer", False): 1, ("train", False): 3, ("infer", True): 2, ("train", True): 3}


class StageMemory(NamedTuple):
    """Bytes per device of one model-stage: parked state and extra bytes while running."""

    resident: float
    working: float

    @property
    def peak(self) -> float:
        return self.resident + self.working


def state_bytes(cfg: ModelConfig, stage: str, tp: int, pp: int, optimizer_shards: int = 1, ep: int = 1) -> float:
    """What one device of one of ``stage``'s units holds (the state a transition moves). ``optimizer_shards``:
    replicas a training stage's optimizer state is split over (plan.shard_optimizer: its dp), each holding
    1/optimizer_shards of Adam's moments."""
    kind, head = split_stage(stage)[1], stage_head(stage)
    params = counts.params_per_device(cfg, tp, pp, head, ep=ep)
    if split_stage(stage)[0] in ("actor", "critic"):  # LoRA adapters; the reference is the base alone
        params += counts.adapter_params_per_device(cfg, tp, pp)
    if kind != "train":
        return params * counts.dtype_bytes(cfg.compute_dtype)
    pb = counts.dtype_bytes(cfg.param_dtype)
    trainable = counts.trainable_params_per_device(cfg, tp, pp, head, ep=ep)  # LoRA: only adapters have Adam state
    return params * pb + trainable * (8 / optimizer_shards + (4 if pb != 4 else 0))


def share_group(cfg: ModelConfig, stage: str) -> str | None:
    """Which units may hold ``stage``'s frozen base as one copy (None: it shares nothing): "actor" for the
    stages that start from the actor's parameters (``StageDecl.state`` "actor" or "base": actor-gen,
    actor-train, ref-infer) and for the critic's when its trunk is the actor's (no ``model.critic_hf_path``);
    "critic" for a critic from its own checkpoint (no other unit holds that trunk). None without
    ``model.lora_rank`` (training updates every parameter: nothing is frozen), for a reward model (its own
    checkpoint) and for a stage without state of its own (a rider)."""
    if not cfg.lora_rank:
        return None
    state = stage_decl(stage).state
    if state in ("actor", "base"):
        return "actor"
    if state == "critic":
        return "critic" if cfg.critic_hf_path else "actor"
    return None


def state_dtype(cfg: ModelConfig, stage: str) -> str:
    """The dtype ``stage``'s units hold parameters in: ``param_dtype`` for training, ``compute_dtype`` for
    scoring and generation (as :func:`state_bytes` counts them)."""
    return cfg.param_dtype if split_stage(stage)[1] == "train" else cfg.compute_dtype


def frozen_base_bytes(cfg: ModelConfig, stage: str, tp: int, pp: int, ep: int = 1) -> float:
    """Bytes per device of the frozen base one of ``stage``'s units holds under (tp, pp, ep), in its
    :func:`state_dtype`: every parameter but the adapters and a value head. The actor's (and the reference's)
    includes the lm head when it is untied; a critic's is the trunk alone, so it nests inside the actor's at
    the same layout and dtype. 0 where :func:`share_group` is None (nothing frozen to share)."""
    if share_group(cfg, stage) is None:
        return 0.0
    if stage_decl(stage).state == "critic":
        params = counts.params_per_device(cfg, tp, pp, "value", num_labels=0, ep=ep)
    else:
        params = counts.params_per_device(cfg, tp, pp, "lm", ep=ep)
    return params * counts.dtype_bytes(state_dtype(cfg, stage))


def optimizer_shards(stage: str, dp, workload: Workload):
    """Replicas a stage's optimizer state is split over: dp for a training stage with
    ``workload.shard_optimizer`` (``dp`` may be an array), else 1."""
    return dp if workload.shard_optimizer and split_stage(stage)[1] == "train" else 1


def resident_bytes(cfg: ModelConfig, stage: str, tp: int, pp: int, optimizer_shards: int = 1, ep: int = 1) -> float:
    """Bytes one device keeps for ``stage`` between its runs (depends on the layout, and for a training stage
    whose optimizer is split over its replicas on their number): its unit's state, and for gen the engine's
    own copy of the weights beside it (per-layer arrays in the compute dtype, ``JaxEngine.adopt_params``),
    held for as long as the engine lives."""
    unit = state_bytes(cfg, stage, tp, pp, optimizer_shards, ep)
    return 2 * unit if split_stage(stage)[1] == "gen" else unit


def working_bytes(cfg: ModelConfig, stage: str, choice: StageChoice, workload: Workload, hw: Hardware,
                  accumulating: bool | None = None) -> float:
    """Extra bytes one device needs while ``stage`` runs under ``choice`` (its largest moment).
    ``accumulating`` (train: more than one call per update, so a running gradient sum is kept) defaults
    to what ``choice`` and ``workload`` imply."""
    kind = split_stage(stage)[1]
    if kind == "gen":
        return hw.workspace_bytes + _gen(cfg, stage_head(stage), choice, workload, hw)
    if accumulating is None:
        accumulating = workload.train_sequences / choice.dp / choice.micro_batch > 1
    return call_working_bytes(cfg, stage, choice.tp, choice.pp, choice.micro_batch, choice.remat, workload, hw,
                              accumulating, choice.ep)


def stage_memory(cfg: ModelConfig, stage: str, choice: StageChoice, workload: Workload, hw: Hardware) -> StageMemory:
    """Resident and working bytes per device of ``stage`` under ``choice``."""
    shards = optimizer_shards(stage, choice.dp, workload)
    return StageMemory(resident_bytes(cfg, stage, choice.tp, choice.pp, shards, choice.ep),
                       working_bytes(cfg, stage, choice, workload, hw))


def device_peak_bytes(stages: Iterable[StageMemory]) -> float:
    """Peak of one device hosting these model-stages: every resident state plus the largest working set
    (model-stages that share devices run one after another)."""
    items = list(stages)
    return sum(m.resident for m in items) + max((m.working for m in items), default=0.0)


def accumulation_bytes(cfg: ModelConfig, stage: str, tp: int, pp: int, ep: int = 1) -> float:
    """The running gradient sum a train stage keeps when a step has more than one call."""
    return (counts.trainable_params_per_device(cfg, tp, pp, stage_head(stage), ep=ep)
            * counts.dtype_bytes(cfg.param_dtype))


def _logit_bytes(cfg: ModelConfig, head: str, rows: float, tp: int) -> float:
    """float32 logits of ``rows`` positions on one device (vocab split over tp)."""
    return rows * (cfg.vocab_size / tp if head == "lm" else 1) * 4.0


def head_bytes(cfg: ModelConfig, head: str, positions: float, tp: int, kind: str, vocab_chunk: int) -> float:
    """The output head's float32 working set on one device for ``positions`` positions: ``_HEAD_ARRAYS`` arrays
    of [positions, columns], columns = the vocabulary's chunk width (the whole vocabulary when ``vocab_chunk``
    is 0 or covers it) over tp; a value head's [positions, 1] twice."""
    if head != "lm":
        return 2 * positions * 4.0
    chunked = 0 < vocab_chunk < cfg.vocab_size
    columns = chunk_width(cfg.vocab_size, vocab_chunk) if chunked else cfg.vocab_size
    return _HEAD_ARRAYS[kind, chunked] * positions * columns / tp * 4.0


def _gen(cfg: ModelConfig, head: str, c: StageChoice, wl: Workload, hw: Hardware) -> float:
    slots = min(c.micro_batch, wl.generated_sequences / c.dp)
    cache = slots * wl.max_tokens * counts.kv_bytes_per_token(cfg, c.tp, 1, cfg.compute_dtype)
    p = wl.prompt_length.max
    prefill = p * counts.layer_activation_bytes_per_token(cfg, c.tp, cfg.compute_dtype)
    if not hw.fused_attention:
        prefill += counts.attention_score_bytes(cfg, c.tp, p, p, cfg.compute_dtype)
    return cache + 2 * _logit_bytes(cfg, head, slots, c.tp) + prefill


def call_working_bytes(cfg: ModelConfig, stage: str, tp: int, pp: int, micro_batch, remat: bool, workload: Workload,
                       hw: Hardware, accumulating: bool, ep: int = 1) -> float:
    """Working bytes of an infer/train call of ``micro_batch`` sequences (an int, or an array of sizes); ep
    only shrinks a training call's gradients (1/ep of the experts')."""
    kind, head = split_stage(stage)[1], stage_head(stage)
    assert kind in ("infer", "train"), stage
    rows = micro_batch / pipeline_microbatches(micro_batch, pp)
    fn = _infer if kind == "infer" else _train
    return hw.workspace_bytes + fn(cfg, head, tp, pp, micro_batch, rows, remat, workload, hw, accumulating, ep)


def _infer(cfg, head, tp, pp, mb, rows, remat, wl: Workload, hw: Hardware, accumulating: bool, ep: int = 1):
    s = wl.max_tokens
    hidden = mb * s * cfg.hidden_size * counts.dtype_bytes(cfg.compute_dtype)
    layer = rows * s * counts.layer_activation_bytes_per_token(cfg, tp, cfg.compute_dtype)
    if not hw.fused_attention:
        layer = layer + rows * counts.attention_score_bytes(cfg, tp, s, s, cfg.compute_dtype)
    logits = head_bytes(cfg, head, mb * wl.head_tokens / head_split(mb, pp), tp, "infer", wl.vocab_chunk)
    return 2 * hidden + layer + logits


def _train(cfg, head, tp, pp, mb, rows, remat, wl: Workload, hw: Hardware, accumulating: bool, ep: int = 1):
    s, layers, m = wl.max_tokens, cfg.num_layers / pp, mb / rows
    grads = counts.trainable_params_per_device(cfg, tp, pp, head, ep=ep) * counts.dtype_bytes(cfg.param_dtype)
    grads *= 2 if accumulating else 1  # this call's gradient and the running sum (accumulation_bytes)
    act = counts.dtype_bytes(cfg.compute_dtype)
    per_token = counts.layer_activation_bytes_per_token(cfg, tp, cfg.compute_dtype)
    scores = 0.0 if hw.fused_attention else counts.attention_score_bytes(cfg, tp, s, s, cfg.compute_dtype)
    layer_input = s * cfg.hidden_size * act  # one row's input to one layer (a stage input is one of these)

    def activations(ticks):  # what the backward reads, for ``ticks`` micro-batches of ``rows`` rows
        if remat:  # layer inputs, plus one layer of one micro-batch recomputed
            return layers * ticks * rows * layer_input + rows * (s * per_token + scores)
        return layers * ticks * rows * (s * per_token + scores)

    if one_f_one_b(pp, wl):  # stashed stage inputs, one micro-batch's activations, its logits on the last stage
        stored = stash_microbatches(m, pp) * rows * layer_input + activations(1)
        logits = head_bytes(cfg, head, rows * wl.head_tokens, tp, "train", wl.vocab_chunk)
    else:  # GPipe, differentiated through: every tick's activations (bubble ticks' too) until the backward
        stored = activations(m + pp - 1)
        logits = head_bytes(cfg, head, mb * wl.head_tokens / head_split(mb, pp), tp, "train", wl.vocab_chunk)
    hidden = 2 * mb * s * cfg.hidden_size * act  # the stack's input and its cotangent (or output)
    return grads + stored + hidden + logits


def frozen_base_key(cfg: ModelConfig, stage: str, tp: int, pp: int, ep: int = 1):
    """``Topology.device_bytes``'s ``shared`` answer for one stage of network ``cfg`` under (tp, pp, ep): (key,
    frozen base bytes per device), None where it holds no shareable base. The key is what units holding one copy
    have in common besides the replica: the share group, the network, the layout and the dtype."""
    group = share_group(cfg, stage)
    base = frozen_base_bytes(cfg, stage, tp, pp, ep) if group is not None else 0.0
    if not base:
        return None
    return (group, cfg, tp, pp, ep, state_dtype(cfg, stage)), base
