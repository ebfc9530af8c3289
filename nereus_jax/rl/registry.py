"""The registered RL algorithms and their published defaults, without JAX: the planner, the simulator and the
config checks read which algorithms train a critic or need groups; ``rl.algorithms`` holds their math."""

from __future__ import annotations

from typing import NamedTuple


class AlgorithmSpec(NamedTuple):
    """One algorithm and its published defaults (an ``algorithm.*`` key left null takes them)."""

    advantage: str            # name in rl.algorithms.ADVANTAGES
    uses_critic: bool         # trains a value model (critic-infer, critic-train stages)
    needs_group: bool         # needs samples_per_prompt >= 2
    needs_greedy_baseline: bool
    loss_agg: str = "token-mean"  # algorithm.loss_agg
    clip_ratio_low: float | None = None   # None: algorithm.clip_ratio
    clip_ratio_high: float | None = None  # None: algorithm.clip_ratio
    ratio_level: str = "token"    # "sequence": GSPO's length-normalised sequence ratio
    dynamic_sampling: bool = False  # algorithm.dynamic_sampling
    overlong_buffer_fraction: float = 0.0  # algorithm.overlong_buffer as a fraction of max_response_length


ALGORITHMS: dict[str, AlgorithmSpec] = {
    # PPO (Schulman et al. 2017) with GAE and a critic; GRPO (Shao et al. 2024) as verl runs it, token-mean (the
    # paper's per-sequence mean is algorithm.loss_agg=seq-mean-token-mean); RLOO and ReMax with their baselines.
    "ppo": AlgorithmSpec("gae", uses_critic=True, needs_group=False, needs_greedy_baseline=False),
    "grpo": AlgorithmSpec("grpo", uses_critic=False, needs_group=True, needs_greedy_baseline=False),
    "rloo": AlgorithmSpec("rloo", uses_critic=False, needs_group=True, needs_greedy_baseline=False),
    "remax": AlgorithmSpec("remax", uses_critic=False, needs_group=False, needs_greedy_baseline=True),
    # DAPO (arXiv 2503.14476): clip-higher 0.2 / 0.28, dynamic sampling, token-level loss, soft overlong
    # punishment over the last fifth of the response budget (the paper: 4,096 of 20,480 tokens).
    "dapo": AlgorithmSpec("grpo", uses_critic=False, needs_group=True, needs_greedy_baseline=False,
                          clip_ratio_low=0.2, clip_ratio_high=0.28, dynamic_sampling=True,
                          overlong_buffer_fraction=0.2),
    # Dr.GRPO (arXiv 2503.20783): no std normalisation, per-sequence token sums over a constant (the budget).
    "dr_grpo": AlgorithmSpec("dr_grpo", uses_critic=False, needs_group=True, needs_greedy_baseline=False,
                             loss_agg="seq-mean-token-sum-norm"),
    # GSPO (arXiv 2507.18071): sequence-level ratio and clipping (3e-4 / 4e-4), per-sequence mean.
    "gspo": AlgorithmSpec("grpo", uses_critic=False, needs_group=True, needs_greedy_baseline=False,
                          loss_agg="seq-mean-token-mean", clip_ratio_low=3e-4, clip_ratio_high=4e-4,
                          ratio_level="sequence"),
}


def algorithm_spec(name: str) -> AlgorithmSpec:
    """The registered algorithm ``name``; unknown names list the registered ones."""
    if name not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {name!r}; registered: {sorted(ALGORITHMS)}")
    return ALGORITHMS[name]
