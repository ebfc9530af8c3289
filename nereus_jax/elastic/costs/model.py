"""The CostModel object: the learned efficiencies, online calibration (``observe``) and transition costs.

Everything it predicts comes from the pure functions of ``latency`` and ``memory``. The object holds one
large-call efficiency per operation class (gemm, attention, memory, collective per link type, host
transfers, launch overhead) and how the compute classes fall off with the size of a call (Hockney's
n_1/2, :data:`~nereus_jax.elastic.costs.latency.SIZE_TERMS`): a GEMM of ``rows`` tokens and sharded
``width`` runs at 1 / (u (1 + h_rows / rows + h_width / width)) of peak, attention over ``keys`` keys at
1 / (u (1 + h_keys / keys)). Classes never measured start from the hardware table's measured value or,
without one, conservatively at 0.3 of peak; size terms start at the table's measured n_1/2 (else 0).

``observe`` refits from measured stage times. A prediction is linear in the parameters theta = (u per
class, u_gemm h_rows, u_gemm h_width, u_attention h_keys) for a given roofline branch, so the fit is least
squares on relative error over the parameters the measurements exercise, with a weak pull towards the
previous values; the size terms are fitted only once some model-stage was measured at sizes apart (one size
cannot tell a slow class from a size effect). The roofline may switch a phase between compute and memory when
efficiencies move, so the fit repeats a few times and keeps the parameters that predict the measurements
best (the start included). The fit also keeps a covariance of theta (Bayesian linear regression: a prior
spread per parameter, the measurements' residual noise), so a prediction comes with an uncertainty that is
small near what was measured and grows with the distance from it (:meth:`CostModel.variance`).

    cm = CostModel("cpu")
    cm.observe([Measurement(cfg, "actor-train", choice, workload, seconds=1.7), ...])
    cm.stage_latency(cfg, "actor-train", choice, workload).total
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from nereus_jax.config import ModelConfig
from nereus_jax.elastic.costs.latency import SIZE_TERMS, Breakdown, call_sizes, stage_latency
from nereus_jax.elastic.costs.memory import StageMemory, stage_memory
from nereus_jax.elastic.costs.stage import StageChoice
from nereus_jax.elastic.hardware import EFFICIENCY_CLASSES, Hardware, get_hardware
from nereus_jax.elastic.workload import Workload
from nereus_jax.model_stage import split_stage

LINK_TYPES = ("local", "intra", "inter", "host")
_LINK_CLASS = {"local": "memory", "intra": "collective_intra", "inter": "collective_inter", "host": "host"}
EFFICIENCY_BOUNDS = (0.01, 2.0)  # a fit outside this range means the measurement is not of this work
PARAMETERS = (*EFFICIENCY_CLASSES, *SIZE_TERMS)
_G, _A = EFFICIENCY_CLASSES.index("gemm"), EFFICIENCY_CLASSES.index("attention")
_SIZED = {"gemm_rows": _G, "gemm_width": _G, "attention_keys": _A}  # size term -> the class it slows
SIZE_SPREAD = 1.5  # size terms are fitted once one model-stage's measured sizes span this ratio
# Prior spread of each parameter (Bayesian covariance): a large-call efficiency within ~30% of its start;
# n_1/2 of the order of a GPU tile (128 rows or columns) or of an attention block sweep (256 keys).
PRIOR_RELATIVE_SD = 0.3
PRIOR_HALF_SD = {"gemm_rows": 128.0, "gemm_width": 128.0, "attention_keys": 256.0}
NOISE_FLOOR = 0.02  # relative run-to-run noise a stage time is assumed to carry at least


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
    """Predictions for one hardware kind: a large-call efficiency per operation class and the size terms."""

    def __init__(self, hardware: Hardware | str, efficiency: Mapping[str, float] | None = None,
                 half_sizes: Mapping[str, float] | None = None):
        self.hardware = get_hardware(hardware) if isinstance(hardware, str) else hardware
        unknown = set(efficiency or {}) - set(EFFICIENCY_CLASSES)
        if unknown:
            raise ValueError(f"unknown efficiency classes {sorted(unknown)}; valid: {', '.join(EFFICIENCY_CLASSES)}")
        unknown = set(half_sizes or {}) - set(SIZE_TERMS)
        if unknown:
            raise ValueError(f"unknown size terms {sorted(unknown)}; valid: {', '.join(SIZE_TERMS)}")
        self._eff = {c: self.hardware.prior_efficiency(c) for c in EFFICIENCY_CLASSES}
        self._eff.update(efficiency or {})
        self._half = {t: float(self.hardware.half_sizes.get(t, 0.0)) for t in SIZE_TERMS}
        self._half.update(half_sizes or {})
        self.observed: set[str] = set()  # parameters some measurement has informed
        self._cov = self._prior_cov()

    @property
    def efficiency(self) -> dict[str, float]:
        """Current large-call efficiency per class (a copy)."""
        return dict(self._eff)

    @property
    def half_sizes(self) -> dict[str, float]:
        """Current n_1/2 per size term (a copy)."""
        return dict(self._half)

    @property
    def efficiency_vector(self) -> tuple[float, ...]:
        """Large-call efficiencies in class order (no size effect)."""
        return tuple(self._eff[c] for c in EFFICIENCY_CLASSES)

    def theta(self) -> np.ndarray:
        """The linear parameters: 1 / efficiency per class, then u h per size term."""
        u = [1.0 / self._eff[c] for c in EFFICIENCY_CLASSES]
        return np.array(u + [u[_SIZED[t]] * self._half[t] for t in SIZE_TERMS])

    def _set_theta(self, theta: np.ndarray, which) -> None:
        for i in which:
            if i < len(EFFICIENCY_CLASSES):
                self._eff[EFFICIENCY_CLASSES[i]] = 1.0 / theta[i]
        for i in which:
            if i >= len(EFFICIENCY_CLASSES):
                t = PARAMETERS[i]
                self._half[t] = max(0.0, float(theta[i])) / (1.0 / self._eff[EFFICIENCY_CLASSES[_SIZED[t]]])
        self.observed.update(PARAMETERS[i] for i in which)

    def efficiency_at(self, rows, width, keys) -> tuple:
        """Efficiencies in class order for calls of these sizes (arrays give arrays)."""
        h = self._half
        eff = list(self.efficiency_vector)
        if h["gemm_rows"] or h["gemm_width"]:
            eff[_G] = eff[_G] / (1.0 + h["gemm_rows"] / rows + h["gemm_width"] / width)
        if h["attention_keys"]:
            eff[_A] = eff[_A] / (1.0 + h["attention_keys"] / keys)
        return tuple(eff)

    def efficiency_for(self, cfg: ModelConfig, stage: str, choice: StageChoice, workload: Workload) -> tuple:
        """The efficiency vector of ``stage``'s calls under ``choice`` (:func:`call_sizes`)."""
        return self.efficiency_at(*call_sizes(cfg, split_stage(stage)[1], choice.tp, choice.pp, choice.dp,
                                              choice.micro_batch, workload))

    def stage_latency(self, cfg: ModelConfig, stage: str, choice: StageChoice, workload: Workload) -> Breakdown:
        """Predicted seconds per class of ``stage`` for one step."""
        return stage_latency(cfg, stage, choice, workload, self.hardware,
                             self.efficiency_for(cfg, stage, choice, workload))

    def stage_memory(self, cfg: ModelConfig, stage: str, choice: StageChoice, workload: Workload) -> StageMemory:
        """Resident and working bytes per device of ``stage``."""
        return stage_memory(cfg, stage, choice, workload, self.hardware)

    def transfer_seconds(self, nbytes: float, link: str) -> float:
        return transfer_seconds(nbytes, link, self.hardware, self._eff)

    def transition_seconds(self, bytes_by_link: Mapping[str, float]) -> float:
        return transition_seconds(bytes_by_link, self.hardware, self._eff)

    # ------------------------------------------------------------------------------ features
    def features(self, cfg: ModelConfig, stage: str, choice: StageChoice, workload: Workload) -> np.ndarray:
        """The prediction's coefficients on :meth:`theta` (its roofline branches at the current values):
        ``features(...) @ theta()`` is ``stage_latency(...).total``."""
        rows, width, keys = call_sizes(cfg, split_stage(stage)[1], choice.tp, choice.pp, choice.dp,
                                       choice.micro_batch, workload)
        eff = self.efficiency_at(rows, width, keys)
        ideal = np.array(stage_latency(cfg, stage, choice, workload, self.hardware, eff).ideal(eff))
        return np.concatenate([ideal, [ideal[_G] / rows, ideal[_G] / width, ideal[_A] / keys]])

    def variance(self, features: np.ndarray) -> float:
        """Variance (seconds^2) of a prediction (or of a difference of predictions) with these features."""
        return float(features @ self._cov @ features)

    def _prior_cov(self) -> np.ndarray:
        theta = self.theta()
        sd = [PRIOR_RELATIVE_SD * theta[i] for i in range(len(EFFICIENCY_CLASSES))]
        sd += [theta[_SIZED[t]] * PRIOR_HALF_SD[t] for t in SIZE_TERMS]
        return np.diag(np.square(sd))

    # ------------------------------------------------------------------------------ calibration
    def observe(self, measurements: Iterable[Measurement], prior_weight: float = 0.05,
                rounds: int = 3) -> dict[str, float]:
        """Refit the parameters these measurements exercise; returns the new large-call efficiencies."""
        items = list(measurements)
        if not items:
            return self.efficiency
        for m in items:
            if m.seconds <= 0:
                raise ValueError(f"measured seconds must be > 0, got {m.seconds} for {m.stage}")
        seconds = np.array([m.seconds for m in items])
        sized = self._spread(items)
        best: tuple[float, dict, dict, set, np.ndarray] | None = None
        for i in range(rounds + 1):  # the start, then each round's fit: keep the one that predicts best
            rows = np.array([self.features(m.model, m.stage, m.choice, m.workload) for m in items]) / seconds[:, None]
            error = float(np.sqrt(np.mean((rows @ self.theta() - 1.0) ** 2)))
            if best is None or error < best[0]:
                best = (error, dict(self._eff), dict(self._half), set(self.observed), rows)
            if i == rounds:
                break
            self._fit(rows, prior_weight, sized)
        _, self._eff, self._half, self.observed, rows = best
        self._update_cov(rows)
        return self.efficiency

    @staticmethod
    def _spread(items: list[Measurement]) -> set[str]:
        """Size terms some model-stage was measured at sizes ``SIZE_SPREAD`` apart: the same work at two
        sizes tells a size effect from a slow class (different stages at different sizes do not)."""
        by_stage: dict[str, list[tuple[float, ...]]] = {}
        for m in items:
            sizes = call_sizes(m.model, split_stage(m.stage)[1], m.choice.tp, m.choice.pp, m.choice.dp,
                               m.choice.micro_batch, m.workload)
            by_stage.setdefault(m.stage, []).append(tuple(float(np.asarray(v)) for v in sizes))
        out = set()
        for sizes in map(np.array, by_stage.values()):
            out |= {t for j, t in enumerate(SIZE_TERMS) if sizes[:, j].max() >= SIZE_SPREAD * sizes[:, j].min()}
        return out

    def _fit(self, rows: np.ndarray, prior_weight: float, sized: set[str]) -> None:
        """Least squares of ``rows @ theta = 1`` (relative residuals) over the exercised parameters, pulled
        towards the current values; large-call efficiencies kept inside ``EFFICIENCY_BOUNDS``, n_1/2 >= 0."""
        n_cls = len(EFFICIENCY_CLASSES)
        share = rows[:, :n_cls].sum(axis=0) / max(rows[:, :n_cls].sum(), 1e-300)
        free = [i for i, s in enumerate(share) if s > 1e-4]  # classes these measurements actually exercise
        free += [n_cls + j for j, t in enumerate(SIZE_TERMS) if t in sized and _SIZED[t] in free]
        if not free:
            return
        theta0 = self.theta()
        # pull per parameter: sqrt(prior_weight) of a relative change of an efficiency; a size term as its prior
        # spread against the measurements' noise (MAP weight NOISE_FLOOR / sd), so a size effect a few times
        # the noise is believed at once
        weight = np.array([np.sqrt(prior_weight) / theta0[i] if i < n_cls else
                           NOISE_FLOOR / (theta0[_SIZED[PARAMETERS[i]]] * PRIOR_HALF_SD[PARAMETERS[i]])
                           for i in range(len(PARAMETERS))])
        lo, hi = 1.0 / EFFICIENCY_BOUNDS[1], 1.0 / EFFICIENCY_BOUNDS[0]
        fixed: dict[int, float] = {}
        for _ in range(len(free) + 1):
            solve = [i for i in free if i not in fixed]
            if not solve:
                break
            rest = [i for i in range(len(theta0)) if i not in solve]
            rhs = np.ones(len(rows)) - rows[:, rest] @ np.array([fixed.get(i, theta0[i]) for i in rest])
            u = np.linalg.lstsq(np.vstack([rows[:, solve], np.diag(weight[solve])]),
                                np.concatenate([rhs, weight[solve] * theta0[solve]]), rcond=None)[0]
            out = {i: float(v) for i, v in zip(solve, u, strict=True)
                   if ((not lo <= v <= hi) if i < n_cls else v < 0)}
            if not out:
                fixed.update({i: float(v) for i, v in zip(solve, u, strict=True)})
                break
            fixed.update({i: (min(max(v, lo), hi) if i < n_cls else 0.0) for i, v in out.items()})
        theta = theta0.copy()
        for i, v in fixed.items():
            theta[i] = v
        self._set_theta(theta, sorted(fixed))

    def _update_cov(self, rows: np.ndarray) -> None:
        """Posterior covariance of theta: the prior spread around the current values and the relative
        residuals of these measurements (noise at least ``NOISE_FLOOR``)."""
        theta = self.theta()
        residual = rows @ theta - 1.0
        noise = max(NOISE_FLOOR, float(np.sqrt(np.mean(residual**2))))
        precision = rows.T @ rows / noise**2 + np.linalg.inv(self._prior_cov())
        self._cov = np.linalg.inv(precision)
