"""Peak memory, state bytes, weight-sync bytes and speed of one actor training step with full fine-tuning vs LoRA
(``model.lora_rank``), on the tiny-math post-training shape, in the same process.

    python tools/bench_lora.py                          # Qwen3-shaped 512 x 4 layers, vocab 32k; rank 16, alpha 32
    python tools/bench_lora.py --model tiny             # the default job's model (configs/models/tiny.yaml)
    python tools/bench_lora.py --rank 8 --alpha 16 --targets q_proj v_proj --repeats 5
    python tools/bench_lora.py --quick                  # a small shape, 2 repeats (tests)

The shape is the default tiny job's (configs/ppo_tiny.yaml): 32 prompts x 4 samples = 128 rows a step, prompts of
12 tokens and responses of 8 (20 columns), PPO's clipped actor loss (KL in the reward, no entropy bonus), AdamW,
the trainer's default 8,192-wide vocabulary chunks, one micro-batch (the trainer's default micro-batch budget of
4,096 tokens holds a step). The job's actor-train runs on all 8 devices (dp 8), so one device trains on
``--rows`` = 128 / 8 = 16 rows: the per-device program is timed and measured here on one device, without the
gradient all-reduce.

The model defaults to ``qwen3-32k`` (Qwen3-shaped: width 512, 4 layers, 8 heads / 4 kv heads of 64, MLP 1,536,
vocab 32,768, tied embeddings, generation in bfloat16; 29.4M parameters), not the job's ``tiny`` (width 64,
2 layers, vocab 128; 0.14M parameters). On ``tiny`` the comparison says little: a rank-16 adapter on a width-64
projection is half the size of the projection itself (the adapters add a third to the base's parameters), and the
whole training state (1.7 MB) is small next to the step's activations (a peak of 11 MB), so LoRA's peak is even
slightly above full fine-tuning's there (measured: 1.03x); at width 512 the adapters add 2% and the parameters,
gradients and Adam moments are most of a step's memory, as in a real post-training job. ``--model tiny`` runs it
anyway.

What is measured, per mode (``full``: lora_rank 0; ``lora``: ``--rank`` / ``--alpha`` on ``--targets``, all seven
projections by default):

- ``peak_bytes_*``: XLA's buffer assignment of the compiled step (``memory_analysis``: arguments + temporaries +
  outputs that do not reuse a donated input), with the parameters and optimizer state donated as the runtime's
  train program does; LoRA's optimizer state covers the adapters only (``losses.init_opt_state``).
- ``state_bytes_*``: ``StateSpec(cfg, "train", optimizer=...).bytes_per_device(Layout())``, the actor-train state
  (params + optimizer state) a transition of actor-train moves per device.
- ``sync_bytes_*`` / ``sync_seconds_*``: one per-step weight sync actor-train -> actor-gen, run by
  ``elastic.weight_sync.WeightSync`` on one device (both stages colocated, same layout: one Derive into the
  generation dtype): the bytes are what its graph writes (the Derive's acquired bytes; equal to the actor-gen
  spec's bytes per device; with LoRA only the adapters are re-derived, the generation units keep the frozen
  base), the seconds the median over ``--repeats`` syncs. ``engine_adopt_seconds_*``: the engine taking the
  synced unit (cast and unstack; with LoRA also merging the adapters into its weights).
- ``train_seconds_*``: the median of ``--repeats`` steps after a warm-up (the state threaded through, donated).
  The achieved FLOP/s counts the step's matmuls: full = 3 x forward; LoRA = 2 x the frozen weights' forward
  (their input gradients, no weight gradients) + 3 x the adapters' and attention's forward.

The machine's limits are measured in the same run: float32 matmul FLOP/s (a square matmul) and copy bandwidth (a
large array copy). Prints one JSON object on its last line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
from machine_limits import QWEN3_MODELS, actor_batch, copy_bytes_per_s, matmul_flops_per_s, median_seconds, peak_bytes

from nereus_jax.config import AlgorithmConfig, ModelConfig
from nereus_jax.elastic.emu import EMU
from nereus_jax.elastic.plan import ExecutionPlan, StagePlan
from nereus_jax.elastic.primitives import DESTROY
from nereus_jax.elastic.shared_base import share_frozen, share_groups, unique_bytes
from nereus_jax.elastic.spec import StateSpec
from nereus_jax.elastic.weight_sync import WeightSync
from nereus_jax.engine import JaxEngine
from nereus_jax.model_stage import ACTOR_GEN, ACTOR_TRAIN, REF_INFER
from nereus_jax.models import init_params
from nereus_jax.models.lora import ALL_TARGETS, base_config, split_trainable, targets
from nereus_jax.runtime.step import losses
from nereus_jax.sharding import Layout, make_mesh

GOAL_PEAK_RATIO_MAX, GOAL_SYNC_RATIO_MAX = 0.5, 0.05
LR = 2.0e-4  # configs/ppo_tiny.yaml trainer.actor_lr

MODELS = {
    # configs/models/tiny.yaml (the ModelConfig defaults): the default job's actor
    "tiny": ModelConfig(),
    **{name: dataclasses.replace(cfg, compute_dtype="bfloat16") for name, cfg in QWEN3_MODELS.items()},
}


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), default="qwen3-32k")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alpha", type=float, default=32.0)
    p.add_argument("--targets", nargs="+", default=list(ALL_TARGETS), choices=ALL_TARGETS)
    p.add_argument("--rows", type=int, default=16, help="rows a device trains on (128 rows over dp 8)")
    p.add_argument("--prompt", type=int, default=12)
    p.add_argument("--response", type=int, default=8)
    p.add_argument("--vocab-chunk", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype-alike", action="store_true",
                   help="colocated stages generate and score in the training dtype (as the tiny jobs do), so all "
                   "three can share the frozen base")
    p.add_argument("--quick", action="store_true", help="model qwen3-8k, 2 repeats")
    args = p.parse_args()
    if args.quick:
        args.model, args.repeats = "qwen3-8k", 2
    return args



def _breakdown(compiled) -> dict:
    m = compiled.memory_analysis()
    return {"arguments": int(m.argument_size_in_bytes), "temporaries": int(m.temp_size_in_bytes),
            "outputs": int(m.output_size_in_bytes), "aliased": int(m.alias_size_in_bytes)}



def _n(tree) -> int:
    return int(sum(np.size(x) for x in jax.tree.leaves(tree)))


def _step_flops(cfg: ModelConfig, rows: int, prompt: int, response: int, lora: bool) -> float:
    """Matmul FLOPs of one training step (see the module docstring)."""
    d, h, k, e, f, n = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size,
                        cfg.num_layers)
    tokens, s = rows * (prompt + response), prompt + response
    weights = 2.0 * tokens * n * (d * h * e + 2 * d * k * e + h * e * d + 3 * d * f) + 2.0 * rows * response * d * \
        cfg.vocab_size
    attention = 2.0 * 2.0 * tokens * n * s * h * e  # scores and values over every column
    if not lora:
        return 3.0 * (weights + attention)
    ins_outs = {"wq": (d, h * e), "wk": (d, k * e), "wv": (d, k * e), "wo": (h * e, d), "w_gate": (d, f),
                "w_up": (d, f), "w_down": (f, d)}
    adapters = sum(2.0 * tokens * n * cfg.lora_rank * sum(ins_outs[t.weight]) for t in targets(cfg))
    return 2.0 * weights + 3.0 * (attention + adapters)


def _mode(cfg: ModelConfig, args: argparse.Namespace, batch: dict, device) -> dict:
    algo = AlgorithmConfig(name="ppo", kl_coef=0.001, kl_in_reward=True, clip_ratio=0.2, lam=0.95)
    optimizer = losses.make_optimizer(LR)
    params = jax.device_put(init_params(cfg, seed=0), device)
    opt_state = losses.init_opt_state(optimizer, params, cfg)
    loss = losses.actor_loss(cfg, algo, args.prompt, vocab_chunk=args.vocab_chunk)
    step = jax.jit(losses.make_train_step(loss, optimizer, cfg), donate_argnums=(0, 1))
    micro = jax.device_put(losses.split_micro({**batch, "denom": np.float32(batch["response_mask"].sum())}, 1),
                           device)
    compiled = step.lower(params, opt_state, micro).compile()
    trainable = split_trainable(params, cfg)[0]
    out = {"peak_bytes": peak_bytes(compiled), "peak_breakdown": _breakdown(compiled), "params": _n(params),
           "trainable_params": _n(trainable),
           "opt_state_bytes": int(sum(x.nbytes for x in jax.tree.leaves(opt_state)))}

    state = {"params": params, "opt": opt_state}

    def train():
        state["params"], state["opt"], metrics = compiled(state["params"], state["opt"], micro)
        state["skipped"] = state.get("skipped", 0.0) + metrics["nonfinite"]  # a non-finite step updates nothing
        return metrics["loss"]

    out["train_seconds"] = median_seconds(train, args.repeats)
    out["skipped_steps"] = int(state.pop("skipped"))
    out["train_flops"] = _step_flops(cfg, args.rows, args.prompt, args.response, bool(cfg.lora_rank))

    train_spec = StateSpec(cfg, "train", optimizer=optimizer)
    gen_spec = StateSpec(cfg, "gen", dtype=cfg.compute_dtype)
    out["state_bytes"] = train_spec.bytes_per_device(Layout())
    out.update(_colocated(train_spec, gen_spec, state, device, args.dtype_alike))
    out.update(_sync(train_spec, gen_spec, state, device, args.repeats))
    return out


def _colocated(train_spec: StateSpec, gen_spec: StateSpec, state: dict, device, alike: bool) -> dict:
    """Bytes ``device`` holds for actor-train, actor-gen and ref-infer colocated on it (the default plan): each
    stage's units as the job lays them out, and with LoRA the same with the frozen base shared where held alike
    (``plan.share_frozen_base``; counted by buffer). ``alike``: generation and scoring in the training dtype."""
    host = jax.tree.map(np.asarray, state)
    cfg = train_spec.model
    dtype = train_spec.dtype if alike else gen_spec.dtype
    gen_spec = StateSpec(cfg, "gen", dtype=dtype)
    ref_spec = StateSpec(base_config(cfg), "infer", dtype=dtype)

    def cast(tree):  # a copy of its own per unit: on CPU a device_put may keep reading the numpy array given
        return {"params": jax.tree.map(lambda x: np.array(jnp.asarray(x, dtype), copy=True), tree)}

    base = split_trainable(host["params"], cfg)[1] if cfg.lora_rank else host["params"]
    units = {ACTOR_GEN: [EMU.create(ACTOR_GEN, gen_spec, Layout(), [device], cast(host["params"]))],
             REF_INFER: [EMU.create(REF_INFER, ref_spec, Layout(), [device], cast(base))],
             ACTOR_TRAIN: [EMU.create(ACTOR_TRAIN, train_spec, Layout(), [device],
                                      jax.tree.map(lambda x: np.array(x, copy=True), host))]}
    held = sum(u.nbytes for us in units.values() for u in us)
    shared = share_frozen(units, share_groups(units, lora=bool(cfg.lora_rank), critic_from_actor=True))
    unique = sum(unique_bytes([u for us in shared.values() for u in us]).values())
    return {"colocated_bytes": held, "colocated_shared_bytes": unique,
            "colocated_others_bytes": unique - units[ACTOR_TRAIN][0].nbytes}


def _sync(train_spec: StateSpec, gen_spec: StateSpec, state: dict, device, repeats: int) -> dict:
    """One weight sync actor-train -> actor-gen by WeightSync, both on ``device`` with one layout."""
    one = StagePlan.contiguous(Layout(), 1)
    plan = ExecutionPlan({ACTOR_TRAIN: one, ACTOR_GEN: one})
    host = jax.tree.map(np.asarray, state)
    train = [EMU.create(ACTOR_TRAIN, train_spec, Layout(), [device], host)]
    gen_host = {"params": jax.tree.map(lambda x: np.asarray(jnp.asarray(x, gen_spec.dtype)), host["params"])}
    units = {"gen": [EMU.create(ACTOR_GEN, gen_spec, Layout(), [device], gen_host)]}
    sync = WeightSync(plan, train_spec, gen_spec)
    written = sum(sum(n for d, n in s.acquire.items() if d >= 0) for s in sync.graph.steps if s.op != DESTROY)

    def once():
        units["gen"] = sync(train, units["gen"])
        return units["gen"][0].leaves

    seconds = median_seconds(once, repeats)
    # what the engine does with each sync: LoRA merges the adapters into its per-layer weights here
    engine = JaxEngine(gen_spec.model, make_mesh([device], Layout()), max_concurrent_decodes=1,
                       max_prefill_length=16, max_target_length=32)
    adopt = median_seconds(lambda: engine.adopt_params(units["gen"][0].params), repeats)
    return {"sync_bytes": int(written), "sync_gen_spec_bytes": gen_spec.bytes_per_device(Layout()),
            "sync_seconds": seconds, "engine_adopt_seconds": adopt, "sync_ops": sorted(s.op for s in sync.graph.steps)}


def run(args: argparse.Namespace) -> dict:
    base = MODELS[args.model]
    device = jax.devices()[0]
    batch = actor_batch(base.vocab_size, args.rows, args.prompt, args.response)
    cfgs = {"full": base, "lora": dataclasses.replace(base, lora_rank=args.rank, lora_alpha=args.alpha,
                                                      lora_targets=tuple(args.targets))}
    out = {name: _mode(cfg, args, batch, device) for name, cfg in cfgs.items()}
    flops, gbps = matmul_flops_per_s(), copy_bytes_per_s()
    f, lo = out["full"], out["lora"]
    peak_ratio = lo["peak_bytes"] / f["peak_bytes"]
    # the job's busiest device: the training step's peak (its state included) + the colocated stages' units
    job_full, job_lora = (m["peak_bytes"] + m["colocated_others_bytes"] for m in (f, lo))
    sync_ratio = lo["sync_bytes"] / f["sync_bytes"]
    return {
        "model": args.model, "hidden_size": base.hidden_size, "num_layers": base.num_layers,
        "vocab": base.vocab_size, "rows": args.rows, "prompt": args.prompt, "response": args.response,
        "tokens": args.rows * (args.prompt + args.response), "vocab_chunk": args.vocab_chunk,
        "rank": args.rank, "alpha": args.alpha, "targets": list(args.targets),
        "total_params": lo["params"], "base_params": f["params"], "adapter_params": lo["params"] - f["params"],
        "trainable_params_lora": lo["trainable_params"],
        "peak_bytes_full": f["peak_bytes"], "peak_bytes_lora": lo["peak_bytes"], "peak_ratio": peak_ratio,
        "peak_breakdown_full": f["peak_breakdown"], "peak_breakdown_lora": lo["peak_breakdown"],
        "colocated_dtype": "training" if args.dtype_alike else "generation",
        "colocated_bytes_full": f["colocated_bytes"], "colocated_bytes_lora_unshared": lo["colocated_bytes"],
        "colocated_bytes_lora": lo["colocated_shared_bytes"],
        "colocated_ratio": lo["colocated_shared_bytes"] / f["colocated_bytes"],
        "job_peak_bytes_full": job_full, "job_peak_bytes_lora": job_lora, "job_peak_ratio": job_lora / job_full,
        "opt_state_bytes_full": f["opt_state_bytes"], "opt_state_bytes_lora": lo["opt_state_bytes"],
        "state_bytes_full": f["state_bytes"], "state_bytes_lora": lo["state_bytes"],
        "transition_bytes_ratio": lo["state_bytes"] / f["state_bytes"],
        "sync_bytes_full": f["sync_bytes"], "sync_bytes_lora": lo["sync_bytes"], "sync_bytes_ratio": sync_ratio,
        "sync_gen_spec_bytes_full": f["sync_gen_spec_bytes"], "sync_gen_spec_bytes_lora": lo["sync_gen_spec_bytes"],
        "sync_seconds_full": f["sync_seconds"], "sync_seconds_lora": lo["sync_seconds"],
        "engine_adopt_seconds_full": f["engine_adopt_seconds"], "engine_adopt_seconds_lora": lo["engine_adopt_seconds"],
        "sync_ops": lo["sync_ops"],
        "train_seconds_full": f["train_seconds"], "train_seconds_lora": lo["train_seconds"],
        "train_speed_ratio": f["train_seconds"] / lo["train_seconds"],
        "skipped_steps_full": f["skipped_steps"], "skipped_steps_lora": lo["skipped_steps"],
        "train_flops_full": f["train_flops"], "train_flops_lora": lo["train_flops"],
        "matmul_flops_per_s": flops, "copy_bytes_per_s": gbps,
        "train_flops_fraction_full": f["train_flops"] / f["train_seconds"] / flops,
        "train_flops_fraction_lora": lo["train_flops"] / lo["train_seconds"] / flops,
        "sync_written_bytes_per_s_full": f["sync_bytes"] / f["sync_seconds"],
        "sync_written_bytes_per_s_lora": lo["sync_bytes"] / lo["sync_seconds"],
        "goal_peak_ratio_max": GOAL_PEAK_RATIO_MAX, "goal_sync_ratio_max": GOAL_SYNC_RATIO_MAX,
        "goal_peak_met": peak_ratio <= GOAL_PEAK_RATIO_MAX, "goal_sync_met": sync_ratio <= GOAL_SYNC_RATIO_MAX,
        "notes": [
            "sync: with LoRA WeightSync re-derives only the adapters (the generation units keep the frozen "
            "base), so sync_bytes_lora is the adapters' bytes in the generation dtype; the engine then merges "
            "them into its per-layer weights (engine_adopt_seconds_lora: local compute, no transfer)",
            "sync_bytes: bytes the sync graph writes on device (its Derive); sync_gen_spec_bytes_* is the actor-gen "
            "spec's bytes per device, the same figure; sync_seconds: WeightSync on one CPU device, colocated, "
            "same layout (no cross-device traffic)",
            "copy_bytes_per_s: read + write of a 256 MiB float32 array into a fresh buffer (its page faults "
            "included), so it is no ceiling for the sync's smaller writes; the sync also reads the float32 "
            "params (2x its bfloat16 writes)",
            "colocated_*: actor-train + actor-gen + ref-infer units on one device (engines' own weight copies not "
            "counted); with LoRA the frozen base is one copy where units hold it alike (same dtype: with "
            "--dtype-alike all three, else actor-gen and ref-infer in the generation dtype); job_peak = the "
            "training step's peak + the other two stages' units",
            "peak: one device's program for --rows rows (the default job's dp 8 share of 128 rows), no gradient "
            "all-reduce",
        ],
        "device": str(device.device_kind), "jax": jax.__version__,
    }




def main() -> None:
    args = _parse()
    if args.rank <= 0:
        raise SystemExit(f"--rank must be > 0, got {args.rank}")
    print(json.dumps(run(args)))


if __name__ == "__main__":
    main()
