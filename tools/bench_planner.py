"""Planner quality against brute force, and decision time at 1,024 GPUs; prints one JSON object last.

    .venv312/bin/python tools/bench_planner.py                 # 240 instances + the 1,024-GPU timing (~3-6 min)
    .venv312/bin/python tools/bench_planner.py --instances 40  # a quicker look

Quality: ``random_problems(seed=0)`` draws small instances (random tiny decoders, algorithms, workloads,
hardware with memory scaled so it binds in a good share of them, pools of 1-32 devices). For each, the
planner's chosen plan is compared with ``exhaustive_search``, which enumerates the same space by brute
force: every combination of per-model-stage resident sizes; for each, the working-set room it leaves,
and then every partition of every phase into concurrent groups, every split of the pool between the
groups and each model-stage's best option for its group's devices. ``within_5pct_fraction`` and
``optimal_fraction`` (within 1e-9) count the instances where the planner matches it.

Decision time: ``Planner.plan`` for every PPO model-stage of Llama-3.1-8B on 1,024 H100s (8 per node),
1,024 prompts of 512 + 2,048 tokens, candidates priced from scratch; the best of ``--repeats`` runs
(the machine is shared) and the median are reported, with the process CPU time (less sensitive to other
load on the 2 shared cores) and the load average at the end.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nereus_jax.config import ModelConfig, resolve_model  # noqa: E402
from nereus_jax.elastic.costs.candidates import StageOptions  # noqa: E402
from nereus_jax.elastic.costs.model import CostModel  # noqa: E402
from nereus_jax.elastic.hardware import HARDWARE  # noqa: E402
from nereus_jax.elastic.planner import Planner, Problem, set_partitions  # noqa: E402
from nereus_jax.elastic.workload import Workload  # noqa: E402

ALGORITHMS = ("ppo", "grpo", "rloo", "remax")


# ------------------------------------------------------------------------------------------ instances
def _random_model(rng: random.Random, i: int) -> ModelConfig:
    heads = rng.choice([1, 2, 2, 4, 3])
    kv = rng.choice([k for k in range(1, heads + 1) if heads % k == 0])
    head_dim = rng.choice([8, 16, 32])
    hidden = heads * head_dim * rng.choice([1, 2])
    return ModelConfig(name=f"rand{i}", vocab_size=rng.choice([256, 384, 1000, 512]), hidden_size=hidden,
                       num_layers=rng.choice([1, 2, 3]), num_heads=heads, num_kv_heads=kv, head_dim=head_dim,
                       intermediate_size=hidden * rng.choice([2, 3, 4]), param_dtype="float32",
                       compute_dtype=rng.choice(["float32", "bfloat16"]))


def random_problems(count: int, seed: int = 0) -> list[tuple[Planner, Problem]]:
    """``count`` small instances from a fixed-seed generator (the same list for the same arguments)."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        cfg = _random_model(rng, i)
        algorithm = rng.choice(ALGORITHMS)
        samples = rng.choice([2, 4]) if algorithm in ("grpo", "rloo") else rng.choice([1, 2])
        prompts = rng.choice([2, 3, 4, 6, 8, 12])
        workload = Workload.fixed(prompts, rng.choice([16, 32, 64, 128]), rng.choice([16, 64, 256, 512]),
                                  samples, greedy_baseline=algorithm == "remax")
        base = HARDWARE[rng.choice(["h100", "h200", "a100", "mi250x"])]
        devices = rng.randint(1, 32)
        hw = dataclasses.replace(base, name=f"{base.name}-scaled", memory_bytes=10**15, workspace_bytes=0)
        roomy = Planner(CostModel(hw)).problem(cfg, algorithm, workload, devices).options()
        # The least any plan needs: every resident state at its smallest plus the smallest working set.
        least = (sum(float(o.resident.min()) for o in roomy.values())
                 + max(float(o.working.min()) for o in roomy.values()))
        hw = dataclasses.replace(hw, memory_bytes=int(least / 0.9 * rng.uniform(0.95, 2.5)))
        planner = Planner(CostModel(hw))
        out.append((planner, planner.problem(cfg, algorithm, workload, devices)))
    return out


# ------------------------------------------------------------------------------------------ brute force
def exhaustive_search(problem: Problem, opts: dict[str, StageOptions] | None = None) -> float:
    """The optimum step latency of ``problem`` by enumeration (math.inf if nothing fits). Small pools only."""
    opts = opts or problem.options()
    stages, pool, usable = problem.stages, len(problem.pool), problem.usable_bytes * (1 + 1e-9)
    levels = {s: sorted(set(opts[s].resident.tolist())) for s in stages}
    memo: dict[tuple, float] = {}
    best = math.inf
    for vector in itertools.product(*(levels[s] for s in stages)):
        room = usable - sum(vector)
        if room < 0:
            continue
        total = 0.0
        chosen = dict(zip(stages, vector, strict=True))
        for phase in problem.phases:
            allowed = {s: [(int(d), float(t)) for d, t, r, w in zip(opts[s].devices, opts[s].latency,
                                                                     opts[s].resident, opts[s].working, strict=True)
                           if r == chosen[s] and w <= room] for s in phase}
            key = (phase, tuple(tuple(allowed[s]) for s in phase))
            if key not in memo:
                memo[key] = _phase_optimum(phase, allowed, pool, problem.concurrent)
            total += memo[key]
        best = min(best, total)
    return best


def _phase_optimum(phase, allowed, pool: int, concurrent: bool) -> float:
    if any(not allowed[s] for s in phase):
        return math.inf

    def best_for(s, n):
        return min((t for d, t in allowed[s] if d <= n), default=math.inf)

    best = math.inf
    for part in set_partitions(list(phase)) if concurrent else [[tuple(phase)]]:
        sizes = [sorted({d for s in g for d, _ in allowed[s] if d <= pool}) for g in part]
        for alloc in itertools.product(*sizes):
            if sum(alloc) <= pool:
                best = min(best, max(sum(best_for(s, n) for s in g) for g, n in zip(part, alloc, strict=True)))
    return best


# ------------------------------------------------------------------------------------------ the runs
def quality(count: int, seed: int) -> dict:
    rows = []
    for planner, problem in random_problems(count, seed):
        opts = problem.options()
        optimum = exhaustive_search(problem, opts)
        result = planner.solve(problem, opts)
        if result is None:
            rows.append((optimum, math.inf))
            continue
        rows.append((optimum, result.step_latency_s))
    feasible = [(o, p) for o, p in rows if math.isfinite(o)]
    agree_infeasible = sum(1 for o, p in rows if not math.isfinite(o) and not math.isfinite(p))
    ratios = [p / o for o, p in feasible]
    return {
        "instances": len(rows),
        "feasible_instances": len(feasible),
        "infeasible_agreed": agree_infeasible,
        "within_5pct_fraction": (sum(r <= 1.05 for r in ratios) + agree_infeasible) / len(rows),
        "optimal_fraction": (sum(r <= 1 + 1e-9 for r in ratios) + agree_infeasible) / len(rows),
        "worst_ratio": max(ratios, default=1.0),
        "mean_ratio": statistics.fmean(ratios) if ratios else 1.0,
    }


def decision_time(repeats: int) -> dict:
    cfg = resolve_model("llama3.1-8b")
    workload = Workload.fixed(1024, 512, 2048)
    times, cpu, result = [], [], None
    for _ in range(repeats):
        planner = Planner("h100")
        start, start_cpu = time.perf_counter(), time.process_time()
        result = planner.plan(cfg, "ppo", workload, 1024)
        times.append((time.perf_counter() - start) * 1e3)
        cpu.append((time.process_time() - start_cpu) * 1e3)
    return {"decision_ms_1024_gpus": min(times), "decision_ms_1024_gpus_median": statistics.median(times),
            "decision_cpu_ms_1024_gpus": min(cpu), "step_latency_s_1024_gpus": result.step_latency_s,
            "gap_1024_gpus": result.gap, "setting_1024_gpus": "llama3.1-8b ppo, 1024 x h100 (8/node), "
            "1024 prompts x (512 + 2048) tokens", "load_average": os.getloadavg()[0]}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--instances", type=int, default=240)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    out = quality(args.instances, args.seed)
    out["quality_seconds"] = time.perf_counter() - start
    out.update(decision_time(args.repeats))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
