"""The simulated cluster's ground truth: what a step and a transition REALLY take, and what memory they
REALLY use. It is a different model from the controller's cost model, which never sees it: the
controller gets measured seconds only and calibrates its one-efficiency-per-class model from them.

How it differs from the cost model:
- achieved efficiency varies with the size of each operation (GEMM rows and sharded width, attention
  length), where the cost model has one constant per class;
- every stage run has run-to-run noise (lognormal) and, rarely, a straggler device that slows its
  whole stage (the slowest replica dominates);
- a transition pays per changed model-stage a setup (new communicators, the new layout's program)
  that the cost model does not price at all, on top of its bytes at size-dependent link efficiency;
- memory: the same byte counts as the cost model plus allocator fragmentation.
It reuses the cost model's WORK counting (FLOPs, bytes, collectives per stage: ``stage_latency`` at
efficiency 1), since a work count is a fact of the model and layout, not a performance model.

Every constant below is fixed from public figures BEFORE any policy is compared, names its source, and
is never tuned to make a policy win. "estimate" marks a constant with no direct published number.

Determinism: every random draw is keyed by (seed, step, stage), so every policy of one run sees the same
noise for the same step and stage (a fair comparison) and a seed reproduces a run bit for bit.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from nereus_jax.config import ModelConfig
from nereus_jax.elastic.costs import StageChoice, counts, stage_latency, stage_memory
from nereus_jax.elastic.costs.latency import Breakdown
from nereus_jax.elastic.hardware import EFFICIENCY_CLASSES, Hardware
from nereus_jax.elastic.workload import Workload
from nereus_jax.model_stage import split_stage, stage_names

# ---------------------------------------------------------------------------------------------- constants
# GEMM: large bf16 GEMMs reach ~80% of dense peak on A100/H100 (NVIDIA Deep Learning Performance Guide,
# "Matrix Multiplication Background": large GEMMs are math-limited near peak; cuBLAS A100 bf16 ~250 of 312
# TFLOPS). Small row counts or narrow sharded widths under-fill the SMs (tile quantisation, same guide):
GEMM_PEAK_EFFICIENCY = 0.80
GEMM_HALF_ROWS = 256.0        # estimate: rows (tokens) per GEMM at which half the peak efficiency is reached
GEMM_HALF_WIDTH = 512.0       # estimate: sharded output width (mlp / tp) at half efficiency
# FlashAttention-2 (Dao, 2023): 50-73% of A100 peak forward, lower backward; short sequences do worse.
ATTENTION_PEAK_EFFICIENCY = 0.60
ATTENTION_HALF_LENGTH = 512.0  # FlashAttention-2 paper, Fig. 4: throughput roughly halves from 16k to 512 keys
# HBM streams: BabelStream-class kernels reach ~85-90% of datasheet bandwidth on A100/H100.
MEMORY_EFFICIENCY = 0.85
# NCCL: nccl-tests all_reduce bus bandwidth on DGX A100 NVLink ~230 of 300 GB/s at large messages (~0.77);
# InfiniBand reaches ~90% of line rate. Small messages are latency-bound; the work count already charges a
# per-hop latency (alpha-beta model), so the efficiency applies to large-message bandwidth only (scaling small
# messages down by size as well would count their latency twice).
COLLECTIVE_INTRA_EFFICIENCY = 0.77
COLLECTIVE_INTER_EFFICIENCY = 0.90
HOST_EFFICIENCY = 0.80        # CUDA bandwidthTest pinned PCIe Gen4 x16: ~25 of 32 GB/s
OVERHEAD_EFFICIENCY = 1.0     # launch/per-layer overheads as the hardware table estimates them
# Run-to-run noise of a stage (coefficient of variation): estimate from the 1-3% step-time spread
# typical of synchronous training logs; the paper reports sd 5.2 s on 858.7 s/step (0.6%) over 5 runs.
NOISE_CV = 0.02
# Stragglers: per device and stage run, the chance that one device runs slow (thermal throttling, a noisy
# neighbour, a flaky link); estimate. Its stage runs ``STRAGGLER_SLOWDOWN`` x slower (slowest replica rules).
STRAGGLER_PER_DEVICE = 1e-4
STRAGGLER_SLOWDOWN = (1.3, 2.0)  # estimate: uniform range of the slowdown
# Allocator fragmentation over the counted bytes (PyTorch/XLA caching allocators; estimate).
FRAGMENTATION = 0.03
# Transition setup per changed model-stage, paid concurrently across model-stages (estimates):
COMMUNICATOR_SETUP_S = 1.0    # new NCCL communicators for the stage's new groups (bootstrap + rings/trees)
PROGRAM_SETUP_S = 2.0         # a new (tp, pp) layout: load its compiled program / re-init the engine
PRIMITIVE_LATENCY_S = 1e-3    # per primitive: launch + synchronisation of one Split/Merge/Extend
# Checkpoint/restart when no live transition exists: the paper's measured UCP restart of an 8B job.
RESTART_S = 836.74


def _saturating(size: float, half: float) -> float:
    return size / (size + half) if size > 0 else 1.0


@dataclass(frozen=True)
class TruthSettings:
    """The knobs a trace may set (defaults: the constants above)."""

    noise_cv: float = NOISE_CV
    straggler_per_device: float = STRAGGLER_PER_DEVICE
    straggler_slowdown: tuple[float, float] = STRAGGLER_SLOWDOWN
    fragmentation: float = FRAGMENTATION

    @classmethod
    def from_mapping(cls, data: Mapping[str, object]) -> TruthSettings:
        values = dict(data)
        if "straggler_slowdown" in values:
            values["straggler_slowdown"] = tuple(float(v) for v in values["straggler_slowdown"])
        return cls(**values)


class GroundTruth:
    """Measured seconds and bytes of the simulated cluster ``hw`` (see the module docstring)."""

    def __init__(self, hw: Hardware, seed: int = 0, settings: TruthSettings | None = None):
        self.hw, self.seed, self.settings = hw, seed, settings or TruthSettings()
        self._ones = tuple(1.0 for _ in EFFICIENCY_CLASSES)

    # ---------------------------------------------------------------------------------- stages
    def efficiency(self, cfg: ModelConfig, stage: str, choice: StageChoice, wl: Workload) -> dict[str, float]:
        """Achieved fraction of peak per class for this stage's operation sizes."""
        kind = split_stage(stage)[1]
        tokens = wl.mean_tokens if wl.packed else wl.max_tokens
        if kind == "gen":
            rows = min(choice.micro_batch, wl.generated_sequences / choice.dp)  # decode rows per step
            length = wl.prompt_length.mean + wl.response_length.mean / 2
        else:
            # every device of an expert group runs all of the call's rows (activations are whole over ep)
            rows = choice.micro_batch * tokens / max(1, min(choice.micro_batch, 4 * choice.pp))
            length = wl.prompt_length.p95 + wl.response_length.p95
        eff = {
            "gemm": GEMM_PEAK_EFFICIENCY * _saturating(rows, GEMM_HALF_ROWS)
            * _saturating(counts.mlp_width(cfg) / choice.tp, GEMM_HALF_WIDTH),
            "attention": ATTENTION_PEAK_EFFICIENCY * _saturating(length, ATTENTION_HALF_LENGTH),
            "memory": MEMORY_EFFICIENCY,
            "collective_intra": COLLECTIVE_INTRA_EFFICIENCY,
            "collective_inter": COLLECTIVE_INTER_EFFICIENCY,
            "host": HOST_EFFICIENCY,
            "overhead": OVERHEAD_EFFICIENCY,
        }
        return {c: eff.get(c, 1.0) for c in EFFICIENCY_CLASSES}

    @staticmethod
    def reference_efficiency() -> dict[str, float]:
        """Per class, the efficiency large operations reach (what an oracle planner may assume)."""
        eff = {"gemm": GEMM_PEAK_EFFICIENCY, "attention": ATTENTION_PEAK_EFFICIENCY, "memory": MEMORY_EFFICIENCY,
               "collective_intra": COLLECTIVE_INTRA_EFFICIENCY, "collective_inter": COLLECTIVE_INTER_EFFICIENCY,
               "host": HOST_EFFICIENCY, "overhead": OVERHEAD_EFFICIENCY}
        return {c: eff[c] for c in EFFICIENCY_CLASSES if c in eff}

    @functools.lru_cache(maxsize=1 << 16)  # noqa: B019 - one truth per simulation; policies share its prices
    def base_seconds(self, cfg: ModelConfig, stage: str, choice: StageChoice, wl: Workload) -> float:
        """Noise-free seconds of ``stage`` under ``choice`` on ``wl``: work at peak / achieved efficiency."""
        ideal: Breakdown = stage_latency(cfg, stage, choice, wl, self.hw, self._ones)
        eff = self.efficiency(cfg, stage, choice, wl)
        return float(sum(t / eff[c] for t, c in zip(ideal, EFFICIENCY_CLASSES, strict=True)))

    def noise(self, step: int, stage: str, devices: int) -> float:
        """The multiplicative noise x straggler factor of ``stage`` at ``step`` (same for every policy)."""
        s = self.settings
        rng = np.random.default_rng([self.seed, step, stage_names().index(stage)])
        sigma = math.sqrt(math.log1p(s.noise_cv**2))
        factor = math.exp(rng.normal(-sigma * sigma / 2, sigma))
        p_straggler = 1.0 - (1.0 - s.straggler_per_device) ** devices
        if rng.random() < p_straggler:
            factor *= rng.uniform(*s.straggler_slowdown)
        return factor

    def stage_seconds(self, cfg: ModelConfig, stage: str, choice: StageChoice, wl: Workload, step: int) -> float:
        """Measured seconds of one stage run at ``step``."""
        return self.base_seconds(cfg, stage, choice, wl) * self.noise(step, stage, choice.devices)

    # ---------------------------------------------------------------------------------- memory
    def stage_bytes(self, cfg: ModelConfig, stage: str, choice: StageChoice, wl: Workload) -> tuple[float, float]:
        """(resident, working) bytes per device as the allocator really holds them."""
        m = stage_memory(cfg, stage, choice, wl, self.hw)
        grow = 1.0 + self.settings.fragmentation
        return m.resident * grow, m.working * grow

    # ---------------------------------------------------------------------------------- links
    def link_seconds(self, link: str, nbytes: float) -> float:
        """Seconds one device takes to move ``nbytes`` over ``link`` (local/intra/inter/host)."""
        if nbytes <= 0:
            return PRIMITIVE_LATENCY_S
        hw = self.hw
        if link == "local":
            rate = hw.memory_bandwidth / 2 * MEMORY_EFFICIENCY
        elif link == "intra":
            rate = hw.intra_node_bandwidth * COLLECTIVE_INTRA_EFFICIENCY
        elif link == "inter":
            rate = hw.inter_node_bandwidth_per_device() * COLLECTIVE_INTER_EFFICIENCY
        else:
            rate = hw.host_bandwidth * HOST_EFFICIENCY
        return PRIMITIVE_LATENCY_S + nbytes / rate

    @staticmethod
    def setup_seconds(layout_changed: bool) -> float:
        """Setup one changed model-stage pays (communicators; plus its program when the layout changed)."""
        return COMMUNICATOR_SETUP_S + (PROGRAM_SETUP_S if layout_changed else 0.0)

    @staticmethod
    def restart_seconds() -> float:
        return RESTART_S
