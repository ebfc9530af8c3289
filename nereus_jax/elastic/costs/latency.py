"""Predicted latency of one model-stage for one RL step, as seconds per efficiency class.

Pure functions of (model config, stage, choice, workload, hardware, efficiencies). Each phase of work
is priced at peak rate divided by its class's efficiency; where a phase is both compute- and
memory-bound (decode, small calls) the roofline takes the larger side and charges it to that class:

- gen: per-request prefill (compute) + decode steps (weights + KV bytes per step vs FLOPs), slots =
  ``choice.micro_batch``; steps = max(longest response, sequences x mean response / slots); plus the
  per-step weight sync from actor-train for the actor.
- infer: calls of ``micro_batch`` sequences; each call a GPipe pass of m + pp - 1 ticks; the output head
  runs after the stack on the response positions (``Workload.head_tokens``), data-parallel over pp when each
  micro-batch's rows divide by pp, else on every stage over the whole call (as ``sharding.pipeline`` does);
  over vocabulary chunks a training backward recomputes the head's logits (4 head passes, not 3).
- train: per optimizer update (mini-batches x epochs of them a step, each over one mini-batch), the same
  calls with forward + backward = 3 x forward FLOPs (4 x with remat), TP all-reduces
  4 per layer (6 with remat), the saved activations written by the forward and read back by the
  backward (memory traffic that scales with tokens), the optimizer update (memory-bound, per replica)
  and the DP gradient all-reduce (hierarchical: inside a node, then across nodes at the node NICs'
  per-device share). With pp > 1 under 1F1B (``Workload.pipeline_schedule``) each stage's backward
  recomputes its forward from the stashed input: 4 x forward FLOPs (5 with remat), 6 TP all-reduces per
  layer (8), and the head runs on the last stage over the call's rows, not split over pp; idle halves of
  its ticks are skipped, so its timeline is the same m + pp - 1 ticks of forward + backward as GPipe's, and
  on shared compute (where an idle stage leaves the host to the busy ones) its work is m ticks and the
  head, which the last stage alone runs, has the host to that stage's devices.

TP all-reduces run inside a node; PP hand-offs cross nodes once a replica spans more than one node.

Expert parallelism (mixture-of-experts scoring and training, ep > 1), as ``sharding.experts`` runs it: the
activations stay whole on every device of a replica's ep group (the batch is not split over ``expert``), so
attention, norms, router, embedding and head run on all of the call's rows on each of them (the dense work is
done ep times over); the routed experts split over the group, so each layer's grouped matmul takes as long as
the busiest device's share of the call's token-expert pairs (``counts.busiest_shard_share`` of
``Workload.expert_load``: 1/ep when balanced); no token moves, and each layer sums the ranks' outputs with one
all-reduce over the ep group of its [rows, hidden] output per forward (one more per backward: its input's
cotangent), over the node's links while tp x ep fits a node, else at its share of the node's NICs. The dense
weights' gradients come out identical on every rank (the same whole activations), so nothing else is reduced
over the group. All of it is priced in the existing classes (GEMM, collective per link), so calibration fits it
like any other work.
On shared-compute hardware (cpu) the stage's devices split the host's FLOP/s and memory bandwidth, and
every device adds launch and per-layer overhead. FLOPs follow the padded row length (``Workload.packed``
False: rows padded to the step's longest sequence, as static-shape JAX programs are) or the mean.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from nereus_jax.config import ModelConfig
from nereus_jax.elastic.costs import counts
from nereus_jax.elastic.costs.memory import optimizer_shards
from nereus_jax.elastic.costs.stage import StageChoice, head_split, one_f_one_b, pipeline_microbatches
from nereus_jax.elastic.hardware import EFFICIENCY_CLASSES, Hardware
from nereus_jax.elastic.workload import Workload
from nereus_jax.model_stage import split_stage, stage_head

GEMM, ATTN, MEM, COLL_INTRA, COLL_INTER, HOST, OVERHEAD = range(len(EFFICIENCY_CLASSES))
_COLL = {"intra": COLL_INTRA, "inter": COLL_INTER}
_NO_STEP_TERMS = frozenset({"ref-infer", "reward-infer", "critic-infer"})  # frozen weights, nothing per step


class Breakdown(NamedTuple):
    """Seconds per efficiency class (at the efficiencies it was computed with)."""

    gemm: float = 0.0
    attention: float = 0.0
    memory: float = 0.0
    collective_intra: float = 0.0
    collective_inter: float = 0.0
    host: float = 0.0
    overhead: float = 0.0

    @property
    def total(self) -> float:
        return sum(self)

    def ideal(self, efficiency: Sequence[float]) -> Breakdown:
        """The same work at efficiency 1 (seconds x efficiency per class): what ``observe`` fits."""
        return Breakdown(*(t * e for t, e in zip(self, efficiency, strict=True)))


def efficiency_vector(hw: Hardware, efficiency: dict[str, float] | None = None) -> tuple[float, ...]:
    """Efficiencies in class order: given ones, else the hardware's priors (conservative if unmeasured)."""
    given = efficiency or {}
    return tuple(given.get(c, hw.prior_efficiency(c)) for c in EFFICIENCY_CLASSES)


# Sizes a class's achieved efficiency depends on (Hockney's n_1/2: a call of size n runs at n / (n + n_1/2) of
# the large-call rate): GEMM rows (tokens per call) and sharded width, attention keys per query.
SIZE_TERMS = ("gemm_rows", "gemm_width", "attention_keys")


def call_sizes(cfg: ModelConfig, kind: str, tp: int, pp: int, dp: int, micro_batch, workload: Workload):
    """(GEMM rows, GEMM width, attention keys) of one stage's typical call: an infer/train call's pipeline
    micro-batch of tokens (padded or packed length; every device of an ep group runs all of them outside the
    experts), a gen decode step's live rows; the MLP width per tp shard. ``micro_batch`` may be an array (then
    rows is one)."""
    wl = workload
    width = counts.mlp_width(cfg) / tp
    if kind == "gen":
        return np.minimum(micro_batch, wl.generated_sequences / dp), width, \
            wl.prompt_length.mean + wl.response_length.mean / 2
    tokens = wl.mean_tokens if wl.packed else wl.max_tokens
    keys = wl.prompt_length.p95 + wl.response_length.p95 if wl.packed else wl.max_tokens
    rows = micro_batch / pipeline_microbatches(micro_batch, pp) * tokens
    return rows, width, keys


# ------------------------------------------------------------------------------------------ primitives
def allreduce_seconds(nbytes: float, members: int, link: str, hw: Hardware) -> float:
    """Ring all-reduce of ``nbytes`` per member over ``members`` devices on a link ("intra"/"inter"),
    at peak bandwidth: 2 (n - 1) / n x bytes / bandwidth plus 2 (n - 1) hop latencies. Either argument
    may be an array (element-wise)."""
    if link == "intra":
        bandwidth, latency = hw.intra_node_bandwidth, hw.intra_node_latency_s
    else:
        bandwidth, latency = hw.inter_node_bandwidth_per_device(), hw.inter_node_latency_s
    if isinstance(nbytes, np.ndarray) or isinstance(members, np.ndarray):
        seconds = 2.0 * (members - 1) / members * nbytes / bandwidth + 2.0 * (members - 1) * latency
        return np.where((np.asarray(members) > 1) & (np.asarray(nbytes) > 0), seconds, 0.0)
    if members <= 1 or nbytes <= 0:
        return 0.0
    return 2.0 * (members - 1) / members * nbytes / bandwidth + 2.0 * (members - 1) * latency


def p2p_seconds(nbytes: float, link: str, hw: Hardware) -> float:
    """One point-to-point send of ``nbytes`` (a pipeline hand-off)."""
    if link == "intra":
        return nbytes / hw.intra_node_bandwidth + hw.intra_node_latency_s
    return nbytes / hw.inter_node_bandwidth_per_device() + hw.inter_node_latency_s


def dp_group_links(dp, replica_devices: int, hw: Hardware):
    """(members per node, nodes) of one DP group when dp replicas of ``replica_devices`` devices are
    placed contiguously: a group stays inside a node while dp * replica size fits one (dp: int or array)."""
    per_node = np.maximum(1, np.minimum(dp, hw.devices_per_node // replica_devices))
    nodes = -(-dp // per_node)  # ceil
    if isinstance(dp, np.ndarray):
        return per_node, nodes
    return int(per_node), int(nodes)


class _Acc:
    """Accumulates seconds per class, dividing by the class efficiency as it goes."""

    __slots__ = ("eff", "t")

    def __init__(self, eff: Sequence[float]):
        self.eff = eff
        self.t = [0.0] * len(EFFICIENCY_CLASSES)

    def add(self, cls: int, ideal_seconds: float, times: float = 1.0) -> None:
        self.t[cls] += times * ideal_seconds / self.eff[cls]

    def roofline(self, gemm_flops, attn_flops, nbytes, rates: tuple[float, float], times=1.0) -> None:
        """The larger of compute and memory time, charged to its class(es). Array arguments price many
        calls at once (element-wise)."""
        flops_rate, byte_rate = rates
        tg = gemm_flops / flops_rate / self.eff[GEMM]
        ta = attn_flops / flops_rate / self.eff[ATTN]
        tm = nbytes / byte_rate / self.eff[MEM]
        if isinstance(tm + tg + ta, np.ndarray):
            memory_bound = tm > tg + ta
            self.t[MEM] = self.t[MEM] + times * np.where(memory_bound, tm, 0.0)
            self.t[GEMM] = self.t[GEMM] + times * np.where(memory_bound, 0.0, tg)
            self.t[ATTN] = self.t[ATTN] + times * np.where(memory_bound, 0.0, ta)
        elif tm > tg + ta:
            self.t[MEM] += times * tm
        else:
            self.t[GEMM] += times * tg
            self.t[ATTN] += times * ta

    def result(self) -> Breakdown:
        return Breakdown(*self.t)


# ------------------------------------------------------------------------------------------ per stage
class _Ctx(NamedTuple):
    cfg: ModelConfig
    model: str  # actor, critic, ref, reward
    head: str
    tp: int
    pp: int
    wl: Workload
    hw: Hardware
    rates: tuple[float, float]  # per-device FLOP/s and memory bytes/s
    act_bytes: int  # activation / compute dtype bytes
    launch: float  # seconds per program launch
    layer_overhead: float  # seconds per layer per tick
    ep: int = 1

    @property
    def layers(self) -> float:
        return self.cfg.num_layers / self.pp

    def ep_link(self) -> str:
        """The expert group's all-reduce link: inside a node while a replica's tp x ep devices fit one."""
        return "intra" if self.tp * self.ep <= self.hw.devices_per_node else "inter"

    def rows_length(self) -> float:
        """Row length FLOPs follow: the padded (max) length, or the mean when rows are packed."""
        return self.wl.mean_tokens if self.wl.packed else self.wl.max_tokens

    def attention_keys(self) -> float:
        """Key positions per row for a full pass (packed rows: p95, since E[s^2] / E[s] exceeds the mean)."""
        if not self.wl.packed:
            return self.wl.max_tokens
        return self.wl.prompt_length.p95 + self.wl.response_length.p95

    def pp_link(self) -> str:
        """A pipeline hand-off's link: inside a node while the whole replica (tp x ep x pp) fits one (the ep
        group sits inside a pipeline stage, so stages are tp x ep devices apart)."""
        return "intra" if self.tp * self.pp * self.ep <= self.hw.devices_per_node else "inter"


def _context(cfg: ModelConfig, stage: str, tp: int, pp: int, devices: int, wl: Workload, hw: Hardware,
             ep: int = 1) -> _Ctx:
    model = split_stage(stage)[0]
    share = devices if hw.shared_compute else 1
    launch = hw.launch_overhead_s + (hw.launch_overhead_per_device_s * devices if hw.shared_compute else 0.0)
    return _Ctx(cfg, model, stage_head(stage), tp, pp, wl, hw,
                (hw.peak_flops / share, hw.memory_bandwidth / share), counts.dtype_bytes(cfg.compute_dtype),
                launch, hw.layer_overhead_s * share, ep)


def _forward_ticks(x: _Ctx, acc: _Acc, rows: float, ticks: float, passes: float, allreduces: float,
                   weight_dtype: str) -> None:
    """``ticks`` pipeline ticks, each running this device's layers on ``rows`` rows ``passes`` times
    (1 forward, 3 forward+backward, 4 with remat) with ``allreduces`` TP all-reduces per layer."""
    if x.ep > 1:
        _expert_parallel_ticks(x, acc, rows, ticks, passes, allreduces, weight_dtype)
        return
    cfg, s = x.cfg, x.rows_length()
    adapters = 2.0 * counts.adapter_params_per_device(cfg, x.tp, cfg.num_layers)  # one layer's (0 without LoRA)
    per_token = base_passes(cfg, passes) * counts.layer_flops_per_token(cfg, x.tp) + passes * adapters
    gemm = per_token * rows * s * x.layers
    attn = passes * rows * x.layers * counts.attention_flops(cfg, x.tp, s, x.attention_keys(), x.hw.fused_attention)
    weights = x.layers * counts.layer_params_per_device(cfg, x.tp) * counts.dtype_bytes(weight_dtype)
    acc.roofline(gemm, attn, passes * weights, x.rates, ticks)
    hidden = rows * s * cfg.hidden_size * x.act_bytes
    acc.add(COLL_INTRA, allreduces * x.layers * allreduce_seconds(hidden, x.tp, "intra", x.hw), ticks)
    if x.pp > 1:
        link = x.pp_link()
        acc.add(_COLL[link], (2.0 if passes > 1 else 1.0) * p2p_seconds(hidden, link, x.hw), ticks)
    acc.add(OVERHEAD, passes * x.layers * x.layer_overhead, ticks)


def _expert_parallel_ticks(x: _Ctx, acc: _Acc, rows: float, ticks: float, passes: float, allreduces: float,
                           weight_dtype: str) -> None:
    """:func:`_forward_ticks` of an ep > 1 replica: each device runs all ``rows`` outside the experts and the
    busiest device's share of the routed pairs in them; one all-reduce of the layer's output over the ep group
    per forward pass and one per backward (``tools/ep_collectives.py``: 1 in the forward, 2 in the gradient)."""
    cfg, s = x.cfg, x.rows_length()
    share = counts.busiest_shard_share(cfg, x.ep, x.wl.expert_load)
    gemm = passes * rows * s * x.layers * (counts.dense_flops_per_token(cfg, x.tp)
                                           + share * counts.expert_flops_per_token(cfg, x.tp))
    attn = passes * rows * x.layers * counts.attention_flops(cfg, x.tp, s, x.attention_keys(), x.hw.fused_attention)
    weights = x.layers * counts.layer_params_per_device(cfg, x.tp, x.ep) * counts.dtype_bytes(weight_dtype)
    acc.roofline(gemm, attn, passes * weights, x.rates, ticks)
    hidden = rows * s * cfg.hidden_size * x.act_bytes
    acc.add(COLL_INTRA, allreduces * x.layers * allreduce_seconds(hidden, x.tp, "intra", x.hw), ticks)
    combines = 1.0 if passes == 1 else passes - 1.0  # every forward (recomputed ones too) and the backward
    link = x.ep_link()
    acc.add(_COLL[link], combines * x.layers * allreduce_seconds(hidden, x.ep, link, x.hw), ticks)
    if x.pp > 1:
        link = x.pp_link()
        acc.add(_COLL[link], (2.0 if passes > 1 else 1.0) * p2p_seconds(hidden, link, x.hw), ticks)
    acc.add(OVERHEAD, passes * x.layers * x.layer_overhead, ticks)


def base_passes(cfg: ModelConfig, passes: float) -> float:
    """Forward-sized GEMM passes a call of ``passes`` makes over frozen-or-trained base weights (1: inference;
    training 3 = forward, input gradient, weight gradient, +1 with remat, +1 under 1F1B's recompute). With LoRA
    the base (layers and lm head) is frozen and XLA drops its weight gradient: one pass less, a third of a dense
    training step's GEMM FLOPs. (The adapters' own GEMMs, 2 FLOPs per adapter weight and token, run every pass.)"""
    return passes - 1.0 if cfg.lora_rank and passes > 1 else passes


def _head_pass(x: _Ctx, acc: _Acc, rows: float, passes: float, split, alone: bool = False) -> None:
    """The output head on ``rows`` rows split over ``split`` stages (:func:`head_split`; 1: one stage runs
    it on all of them, as 1F1B's last stage or GPipe's stages when the rows do not split), plus its
    vocab-parallel reductions. ``alone`` (1F1B): the last stage runs it inside its ticks, after the layer
    work every stage does, so on shared compute the other stages have finished their part of the tick and
    the host is shared by the last stage's devices, not by all pp stages."""
    s = x.wl.head_tokens / split
    flops = (base_passes(x.cfg, passes) if x.head == "lm" else passes) * rows * s * counts.head_flops_per_token(
        x.cfg, x.tp, x.head)  # a value head trains (with LoRA too); the lm head is frozen with the base
    weights = x.cfg.hidden_size * x.cfg.vocab_size / x.tp * x.act_bytes if x.head == "lm" else 0.0
    scale = x.pp if alone and x.hw.shared_compute else 1
    acc.roofline(flops, 0.0, weights, (x.rates[0] * scale, x.rates[1] * scale))
    if x.head == "lm":
        acc.add(COLL_INTRA, 2 * allreduce_seconds(rows * s * 4.0, x.tp, "intra", x.hw))


def chunked_head(cfg: ModelConfig, wl: Workload) -> bool:
    """Whether the lm head runs over vocabulary chunks (its training backward then recomputes the logits)."""
    return 0 < wl.vocab_chunk < cfg.vocab_size


def saved_activation_bytes(x: _Ctx, micro_batch, remat: bool, stash: bool = False) -> float:
    """Bytes one device of a train call keeps from its forward for its backward: every layer's saved
    tensors (norm, SwiGLU and residual inputs; the [t, s] scores without a fused kernel) and the lm head's
    float32 logits over its positions (none over vocabulary chunks: the backward recomputes them); with
    remat, the layer inputs, then each layer's tensors again when it is recomputed.
    The forward writes them to device memory and the backward reads them back (2 x this in traffic),
    which scales with the call's tokens, not with parameters or replicas; an inference forward consumes
    its activations as it makes them. ``stash`` (1F1B): the stage's inputs are kept instead, its tensors
    written by the backward's recompute, and the last stage makes all the call's logits (GPipe: the stages
    make them split as :func:`head_split` says). ep does not change them: activations are whole on every device
    of an ep group, and the experts' buffers are sized by all of the call's token-expert pairs (static shapes)."""
    s = x.rows_length()
    per_row = s * counts.layer_activation_bytes_per_token(x.cfg, x.tp, x.cfg.compute_dtype)
    if not x.hw.fused_attention:
        per_row += counts.attention_score_bytes(x.cfg, x.tp, s, x.attention_keys(), x.cfg.compute_dtype)
    if remat:
        per_row += s * x.cfg.hidden_size * x.act_bytes
    stage_input = s * x.cfg.hidden_size * x.act_bytes if stash else 0.0
    logits = x.wl.head_tokens / (1 if stash else head_split(micro_batch, x.pp)) * x.cfg.vocab_size / x.tp * 4.0 \
        if x.head == "lm" and not chunked_head(x.cfg, x.wl) else 0.0  # chunked: recomputed in the backward
    return micro_batch * (x.layers * per_row + stage_input + logits)


def call_latency(cfg: ModelConfig, stage: str, tp: int, pp: int, micro_batch, remat: bool, workload: Workload,
                 hw: Hardware, efficiency: Sequence[float], devices: int, ep: int = 1) -> Breakdown:
    """One forward (infer) or forward+backward (train) call of ``micro_batch`` sequences on one replica:
    a pipeline pass of m + pp - 1 ticks (GPipe, or 1F1B for training when the workload says so), the output
    head, one launch. ``devices``: the stage's devices. ``micro_batch`` may be an integer array: then every
    field of the result is an array (one per size). ``ep``: the module docstring's expert parallelism."""
    kind = split_stage(stage)[1]
    assert kind in ("infer", "train"), stage
    x = _context(cfg, stage, tp, pp, devices, workload, hw, ep)
    acc = _Acc(efficiency)
    recompute = kind == "train" and one_f_one_b(pp, workload)  # 1F1B: each backward reruns its stage's forward
    passes = 1.0 if kind == "infer" else 3.0 + (1.0 if remat else 0.0) + (1.0 if recompute else 0.0)
    allreduces = 2.0 if kind == "infer" else 4.0 + (2.0 if remat else 0.0) + (2.0 if recompute else 0.0)
    m = pipeline_microbatches(micro_batch, pp)
    weight_dtype = cfg.compute_dtype if kind == "infer" else cfg.param_dtype
    # 1F1B skips its idle half-ticks: on shared compute that frees the host for the busy stages, so the call
    # costs its m ticks of work; elsewhere the devices idle through the bubble (GPipe's bubble ticks compute
    # on zeros anyway)
    ticks = m if recompute and hw.shared_compute else m + pp - 1
    _forward_ticks(x, acc, micro_batch / m, ticks, passes, allreduces, weight_dtype)
    head_passes = 1.0 if kind == "infer" else 4.0 if chunked_head(cfg, workload) else 3.0  # chunks: recomputed
    _head_pass(x, acc, micro_batch, head_passes, 1 if recompute else head_split(micro_batch, pp), alone=recompute)
    if kind == "train":
        acc.add(MEM, 2.0 * saved_activation_bytes(x, micro_batch, remat, stash=recompute) / x.rates[1])
    acc.add(OVERHEAD, x.launch)
    return acc.result()


def step_terms_latency(cfg: ModelConfig, stage: str, tp: int, pp: int, dp, calls: float, workload: Workload,
                       hw: Hardware, efficiency: Sequence[float], ep: int = 1) -> Breakdown:
    """Once-per-step work of an infer/train stage besides its calls: the optimizer update, gradient
    accumulation traffic and the DP gradient all-reduce (train; with ep > 1 a device's 1/ep of the experts' and
    all of the dense weights', whose gradients its ep group computed alike); the actor's weight sync. ``dp`` may
    be an integer array (then so is every field)."""
    if stage in _NO_STEP_TERMS:
        return Breakdown()
    x = _context(cfg, stage, tp, pp, tp * pp * ep * dp, workload, hw, ep)
    acc = _Acc(efficiency)
    if split_stage(stage)[1] == "train":
        params = counts.trainable_params_per_device(cfg, tp, pp, x.head, ep=ep)  # LoRA: the adapters (+ value head)
        pb = counts.dtype_bytes(cfg.param_dtype)
        master = 4 if pb != 4 else 0
        # read p, g, m, v, master; write p, m, v, master: on 1/dp of them where the optimizer is split over dp
        shards = optimizer_shards(stage, dp, workload)
        update = params * (3 * pb + 2 * 8 + 2 * master) / shards
        acc.add(MEM, update / x.rates[1])
        acc.add(MEM, accumulation_seconds(cfg, stage, tp, pp, dp, hw, ep), max(0.0, calls - 1))
        per_node, nodes = dp_group_links(dp, tp * pp * ep, hw)
        acc.add(COLL_INTRA, allreduce_seconds(params * pb, per_node, "intra", hw))
        acc.add(COLL_INTER, allreduce_seconds(params * pb / per_node, nodes, "inter", hw))
        if workload.shard_optimizer:  # each replica updated its block: the parameters are all-gathered over dp
            acc.add(COLL_INTRA, allreduce_seconds(params * pb, per_node, "intra", hw) / 2)
            acc.add(COLL_INTER, allreduce_seconds(params * pb / per_node, nodes, "inter", hw) / 2)
    elif x.model == "actor":
        _weight_sync(x, acc)
    return acc.result()


def accumulation_seconds(cfg: ModelConfig, stage: str, tp: int, pp: int, dp, hw: Hardware, ep: int = 1) -> float:
    """Ideal seconds (class memory) per extra call of a train stage: read + write the running gradient sum."""
    share = tp * pp * ep * dp if hw.shared_compute else 1
    params = counts.trainable_params_per_device(cfg, tp, pp, stage_head(stage), ep=ep)
    return params * counts.dtype_bytes(cfg.param_dtype) * 2 / (hw.memory_bandwidth / share)


def gen_latency(cfg: ModelConfig, stage: str, tp: int, dp: int, slots, workload: Workload, hw: Hardware,
                efficiency: Sequence[float]) -> Breakdown:
    """actor-gen on dp replicas of tp devices with ``slots`` concurrent decode slots per replica (an int,
    or an array to price many at once): prefill, decode steps, and the weight sync."""
    wl = workload
    x = _context(cfg, stage, tp, 1, tp * dp, wl, hw)
    acc = _Acc(efficiency)
    n = wl.generated_sequences / dp
    weights = counts.params_per_device(cfg, tp, 1, x.head) * x.act_bytes
    layer_flops = counts.layer_flops_per_token(cfg, tp) * cfg.num_layers
    head_flops = counts.head_flops_per_token(cfg, tp, x.head)
    # Prefill: one call per request over its (padded) prompt, logits at the last position only.
    p = wl.prompt_length.mean if wl.packed else wl.prompt_length.max
    attn = cfg.num_layers * counts.attention_flops(cfg, tp, p, p, hw.fused_attention)
    acc.roofline(p * layer_flops + head_flops, attn, weights, x.rates, n)
    hidden = p * cfg.hidden_size * x.act_bytes
    acc.add(COLL_INTRA, 2 * cfg.num_layers * allreduce_seconds(hidden, tp, "intra", hw), n)
    acc.add(OVERHEAD, x.launch + cfg.num_layers * x.layer_overhead, n)
    # Decode: every step advances every live slot by one token.
    live = np.minimum(slots, n)
    r = wl.response_length
    steps = np.maximum(float(r.max), np.ceil(n * r.mean / live))
    if hw.fused_attention:  # paged cache: only live rows, only their context
        rows, context = n * r.mean / steps, wl.prompt_length.mean + r.mean / 2
    else:  # our dense engine: every slot, the whole cache length
        rows, context = live, float(wl.max_tokens)
    kv = rows * context * counts.kv_bytes_per_token(cfg, tp, 1, cfg.compute_dtype)
    attn = rows * cfg.num_layers * counts.attention_flops(cfg, tp, 1, context, hw.fused_attention)
    acc.roofline(rows * (layer_flops + head_flops), attn, weights + kv, x.rates, steps)
    hidden = rows * cfg.hidden_size * x.act_bytes
    acc.add(COLL_INTRA, 2 * cfg.num_layers * allreduce_seconds(hidden, tp, "intra", hw), steps)
    acc.add(OVERHEAD, x.launch + cfg.num_layers * x.layer_overhead, steps)
    _weight_sync(x, acc)
    return acc.result()


def _weight_sync(x: _Ctx, acc: _Acc) -> None:
    """Receiving the updated actor weights (cast to the compute dtype) every step; with LoRA only the adapters
    (``WeightSync`` re-derives them alone; the engine's merge is local)."""
    params = (counts.adapter_params_per_device(x.cfg, x.tp, x.pp) if x.cfg.lora_rank
              else counts.params_per_device(x.cfg, x.tp, x.pp, x.head))
    nbytes = params * x.act_bytes
    acc.add(COLL_INTRA, nbytes / x.hw.intra_node_bandwidth + x.hw.intra_node_latency_s)


def calls_per_step(workload: Workload, choice: StageChoice) -> float:
    """Forward calls one replica makes per step (infer stages; a train stage's: ``calls_per_update``)."""
    return workload.sequences / choice.dp / choice.micro_batch


def calls_per_update(workload: Workload, choice: StageChoice) -> float:
    """Forward/backward calls one replica makes per optimizer update (gradient accumulation over a mini-batch)."""
    return workload.train_sequences / choice.dp / choice.micro_batch


def stage_latency(cfg: ModelConfig, stage: str, choice: StageChoice, workload: Workload, hw: Hardware,
                  efficiency: Sequence[float] | None = None) -> Breakdown:
    """Seconds of one RL step spent in ``stage`` (e.g. "actor-train") under ``choice``, per class.

    ``efficiency`` is the vector of ``efficiency_vector`` (default: the hardware's priors)."""
    eff = efficiency if efficiency is not None else efficiency_vector(hw)
    c = choice
    kind = split_stage(stage)[1]
    if kind == "gen":
        assert c.ep == 1, f"{stage}: generation runs with ep=1, got {c}"
        return gen_latency(cfg, stage, c.tp, c.dp, c.micro_batch, workload, hw, eff)
    train = kind == "train"
    calls = calls_per_update(workload, c) if train else calls_per_step(workload, c)
    call = call_latency(cfg, stage, c.tp, c.pp, c.micro_batch, c.remat, workload, hw, eff, c.devices, c.ep)
    step = step_terms_latency(cfg, stage, c.tp, c.pp, c.dp, calls, workload, hw, eff, c.ep)
    updates = workload.updates if train else 1  # each update: its calls, optimizer step and all-reduce
    return Breakdown(*(updates * (calls * a + b) for a, b in zip(call, step, strict=True)))
