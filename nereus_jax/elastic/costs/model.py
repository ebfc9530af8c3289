"""The CostModel object: the learned efficiencies, online calibration (``observe``) and transition costs.

Everything it predicts comes from the pure functions of ``latency`` and ``memory``; the object only
holds ONE efficiency per operation class (gemm, attention, memory, collective per link type, host
transfers, launch overhead). Classes never measured start from the hardware table's measured value or,
without one, conservatively at 0.3 of peak.

``observe`` refits the efficiencies from measured stage times: each prediction is a sum over classes of
(work at peak rate) / efficiency, so with u = 1 / efficiency a measured time is linear in u; the fit is
least squares on relative error over the classes the measurements exercise, with a weak pull towards
the previous values so a class a few measurements barely touch stays put. The roofline may switch a
phase between compute and memory when efficiencies move, so the fit repeats a few times.

    cm = CostModel("cpu")
    cm.observe([Measurement(cfg, "actor-train", choice, workload, seconds=1.7), ...])
    cm.stage_latency(cfg, "actor-train", choice, workload).total
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from nereus_jax.config import ModelConfig
from nereus_jax.elastic.costs.latency import Breakdown, stage_latency
from nereus_jax.elastic.costs.memory import StageMemory, stage_memory
from nereus_jax.elastic.costs.stage import StageChoice
from nereus_jax.elastic.hardware import EFFICIENCY_CLASSES, Hardware, get_hardware
from nereus_jax.elastic.workload import Workload

LINK_TYPES = ("local", "intra", "inter", "host")
_LINK_CLASS = {"local": "memory", "intra": "collective_intra", "inter": "collective_inter", "host": "host"}
EFFICIENCY_BOUNDS = (0.01, 2.0)  # a fit outside this range means the measurement is not of this work


@dataclass(frozen=True)
class Measurement:
    """One measured stage time: ``seconds`` of ``stage`` under ``choice`` on ``workload``."""

    model: ModelConfig
    stage: str
    choice: StageChoice
    workload: Workload
    seconds: float


def link_bandwidth(link: str, hw: Hardware) -> tuple[float, float]:
    """(bytes/s, latency s) of one device's transfers on a link type: "local" (a re-layout copy in
    device memory: read + write), "intra"/"inter" node, "host" (offload / onload)."""
    if link == "local":
        return hw.memory_bandwidth / 2, 0.0
    if link == "intra":
        return hw.intra_node_bandwidth, hw.intra_node_latency_s
    if link == "inter":
        return hw.inter_node_bandwidth_per_device(), hw.inter_node_latency_s
    if link == "host":
        return hw.host_bandwidth, 0.0
    raise ValueError(f"unknown link type {link!r}; valid: {', '.join(LINK_TYPES)}")


def transfer_seconds(nbytes: float, link: str, hw: Hardware, efficiency: Mapping[str, float] | None = None) -> float:
    """Seconds for one device to move ``nbytes`` over ``link`` (one transfer: bandwidth + latency)."""
    if nbytes <= 0:
        return 0.0
    bandwidth, latency = link_bandwidth(link, hw)
    cls = _LINK_CLASS[link]
    eff = (efficiency or {}).get(cls, hw.prior_efficiency(cls))
    return (nbytes / bandwidth + latency) / eff


def transition_seconds(bytes_by_link: Mapping[str, float], hw: Hardware,
                       efficiency: Mapping[str, float] | None = None) -> float:
    """Cost of moving state: ``bytes_by_link`` maps link type -> bytes the busiest device moves on it;
    the links are used one after another (a transition graph schedules overlap itself, pricing each
    primitive with this function)."""
    return sum(transfer_seconds(nbytes, link, hw, efficiency) for link, nbytes in bytes_by_link.items())


class CostModel:
    """Predictions for one hardware kind, with one learned efficiency per operation class."""

    def __init__(self, hardware: Hardware | str, efficiency: Mapping[str, float] | None = None):
        self.hardware = get_hardware(hardware) if isinstance(hardware, str) else hardware
        unknown = set(efficiency or {}) - set(EFFICIENCY_CLASSES)
        if unknown:
            raise ValueError(f"unknown efficiency classes {sorted(unknown)}; valid: {', '.join(EFFICIENCY_CLASSES)}")
        self._eff = {c: self.hardware.prior_efficiency(c) for c in EFFICIENCY_CLASSES}
        self._eff.update(efficiency or {})
        self.observed: set[str] = set()  # classes some measurement has informed

    @property
    def efficiency(self) -> dict[str, float]:
        """Current efficiency per class (a copy)."""
        return dict(self._eff)

    @property
    def efficiency_vector(self) -> tuple[float, ...]:
        return tuple(self._eff[c] for c in EFFICIENCY_CLASSES)

    def stage_latency(self, cfg: ModelConfig, stage: str, choice: StageChoice, workload: Workload) -> Breakdown:
        """Predicted seconds per class of ``stage`` for one step."""
        return stage_latency(cfg, stage, choice, workload, self.hardware, self.efficiency_vector)

    def stage_memory(self, cfg: ModelConfig, stage: str, choice: StageChoice, workload: Workload) -> StageMemory:
        """Resident and working bytes per device of ``stage``."""
        return stage_memory(cfg, stage, choice, workload, self.hardware)

    def transfer_seconds(self, nbytes: float, link: str) -> float:
        return transfer_seconds(nbytes, link, self.hardware, self._eff)

    def transition_seconds(self, bytes_by_link: Mapping[str, float]) -> float:
        return transition_seconds(bytes_by_link, self.hardware, self._eff)

    def observe(self, measurements: Iterable[Measurement], prior_weight: float = 0.05,
                rounds: int = 3) -> dict[str, float]:
        """Refit the efficiencies of the classes these measurements exercise; returns the new values."""
        items = list(measurements)
        if not items:
            return self.efficiency
        for m in items:
            if m.seconds <= 0:
                raise ValueError(f"measured seconds must be > 0, got {m.seconds} for {m.stage}")
        for _ in range(rounds):
            ideal = np.array([self.stage_latency(m.model, m.stage, m.choice, m.workload).ideal(self.efficiency_vector)
                              for m in items])
            seconds = np.array([m.seconds for m in items])
            self._fit(ideal, seconds, prior_weight)
        return self.efficiency

    def _fit(self, ideal: np.ndarray, seconds: np.ndarray, prior_weight: float) -> None:
        share = ideal.sum(axis=0) / max(ideal.sum(), 1e-300)
        free = [i for i, s in enumerate(share) if s > 1e-4]  # classes these measurements actually exercise
        if not free:
            return
        u0 = np.array([1.0 / self._eff[c] for c in EFFICIENCY_CLASSES])
        rows = ideal / seconds[:, None]  # relative residual: (sum_c x_c u_c - t) / t
        lo, hi = 1.0 / EFFICIENCY_BOUNDS[1], 1.0 / EFFICIENCY_BOUNDS[0]
        fixed: dict[int, float] = {}
        for _ in range(len(free) + 1):
            solve = [i for i in free if i not in fixed]
            if not solve:
                break
            rhs = np.ones(len(seconds)) - rows[:, [i for i in range(len(u0)) if i not in solve]] @ \
                np.array([fixed.get(i, u0[i]) for i in range(len(u0)) if i not in solve])
            a = rows[:, solve]
            reg = np.sqrt(prior_weight) * np.diag(1.0 / u0[solve])
            u = np.linalg.lstsq(np.vstack([a, reg]), np.concatenate([rhs, np.sqrt(prior_weight) * np.ones(len(solve))]),
                                rcond=None)[0]
            out = {i: float(v) for i, v in zip(solve, u, strict=True) if not lo <= v <= hi}
            if not out:
                for i, v in zip(solve, u, strict=True):
                    fixed[i] = float(v)
                break
            fixed.update({i: min(max(v, lo), hi) for i, v in out.items()})
        for i, v in fixed.items():
            self._eff[EFFICIENCY_CLASSES[i]] = 1.0 / v
            self.observed.add(EFFICIENCY_CLASSES[i])
