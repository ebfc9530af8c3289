"""The job's prices: what a plan costs per step, how much memory it needs per device, what moving to it
costs, and the calibration that keeps those prices honest; importable without JAX.

One :class:`Pricing` object serves the running job (``runtime.job_pricer``) and the simulator
(``sim.model``), so the same plan and workload get the same prediction in both:

- per model-stage seconds and bytes from the (calibrated) :class:`~nereus_jax.elastic.costs.CostModel`,
  riders priced at their host's layout with no resident state (:mod:`~nereus_jax.elastic.topology`);
- step latency as the topology composes the stages (critical path of its execution-overlap graph: the
  job's stages one after another, async actor-gen beside the rest);
- peak bytes per device: the resident state of every unit on the device plus the largest working set
  among everything that runs there;
- a transition graph's data movement priced with the cost model's link times;
- calibration: measured stage seconds over a window of recent steps refit the efficiencies, and the
  uncertainty of a predicted gain (:meth:`Pricing.gain_sd`) follows from the fit's covariance;
- a memory per layout: the last measurements of every (model-stage, call) the job has run. One that has
  left the window is priced by the fit times its remembered measured / predicted ratio (a bias the shared
  efficiencies do not capture, e.g. a pipeline schedule the model prices optimistically), and counts as
  measured in a gain's uncertainty: coming back to a layout it ran, the controller knows what it costs;
- a planning problem's options re-ranked for the risk of extrapolating to layouts the job has not measured
  (:meth:`Pricing.risk_adjusted`), so the planner can also name the plan that is fast by what was measured.

Plans are anything mapping model-stage -> stage plan with ``devices`` (an ``ExecutionPlan``); choices map
every priced model-stage (riders too) to its :class:`~nereus_jax.elastic.costs.StageChoice`.
"""

from __future__ import annotations

import collections
import math
import statistics
from collections.abc import Iterable, Mapping

import numpy as np

from nereus_jax.config import ModelConfig
from nereus_jax.elastic.costs import CostModel, Measurement, StageChoice
from nereus_jax.elastic.costs.candidates import StageOptions
from nereus_jax.elastic.costs.memory import frozen_base_key
from nereus_jax.elastic.costs.model import NOISE_FLOOR
from nereus_jax.elastic.topology import Topology, critical_path
from nereus_jax.elastic.workload import Workload
from nereus_jax.model_stage import split_stage

CALIBRATION_WINDOW = 8  # steps of measurements the efficiencies are fitted to
REMEMBERED = 8  # measurements kept per (model-stage, call) for the per-layout memory
# Relative sd a prediction gains per doubling of tp, pp or ep away from the nearest layout the job has measured
# for that model-stage: the fitted efficiencies are shared across layouts, so their covariance says nothing
# about effects the features do not model (e.g. a wider tensor-parallel all-reduce than any measured).
EXTRAPOLATION_SD = 0.05


class Pricing:
    """A topology's prices under one cost model; ``usable_bytes`` is the memory a plan may fill per device
    (capacity less the planning headroom); ``share_base``: LoRA's frozen base is held once where units hold it
    alike (``plan.share_frozen_base``)."""

    def __init__(self, cost: CostModel, topology: Topology, models: Mapping[str, ModelConfig], usable_bytes: float,
                 window: int = CALIBRATION_WINDOW, share_base: bool = True):
        self.cost, self.topology, self.models, self.usable_bytes = cost, topology, dict(models), usable_bytes
        self.share_base = share_base
        self.window: collections.deque[list[Measurement]] = collections.deque(maxlen=window)
        self.memory: dict[tuple[str, StageChoice], collections.deque[Measurement]] = {}
        self._ratios: dict[tuple[str, StageChoice], float] = {}  # residuals at the current fit and window
        self._ratios_of: CostModel | None = None  # the cost model _ratios were computed with (it may be replaced)
        self._window_keys: set[tuple[str, StageChoice]] = set()
        self._layouts: dict[str, set[tuple[int, int, int]]] = {}  # model-stage -> (tp, pp, ep) measured on

    @property
    def hardware(self):
        return self.cost.hardware

    def model_for(self, stage: str) -> ModelConfig:
        return self.models[split_stage(stage)[0]]

    # ------------------------------------------------------------------------------------ choices
    def choices(self, plan, workload: Workload) -> dict[str, StageChoice]:
        """Every priced model-stage's call under the topology's batching rule, from the plan's layouts
        (a rider: its host's). ValueError when the plan's dp cannot split a stage's batch."""
        batching = self.topology.batching
        if batching is None:
            raise ValueError("choices from a plan need the topology's batching rule (the job's call sizes)")
        out = {}
        for stage in self.topology.stages:
            sp = _stage_plan(plan, self.topology.host(stage))
            kind = split_stage(stage)[1]
            rows = workload.rows_for(kind)
            mb = batching.micro_batch(kind, rows, sp.dp)
            if mb is None:
                raise ValueError(f"{stage}: dp={sp.dp} does not split its {rows} sequences")
            out[stage] = StageChoice(sp.layout.tp, sp.layout.pp, sp.dp, mb, batching.remat and kind == "train",
                                     getattr(sp.layout, "ep", 1))  # a layout without ep splits no experts
        return out

    # ------------------------------------------------------------------------------------ latency
    def stage_seconds(self, choices: Mapping[str, StageChoice], workload: Workload,
                      workloads: Mapping[str, Workload] | None = None) -> dict[str, float]:
        """Predicted seconds per step of each model-stage (``workloads``: a stage's own batch, else ``workload``)."""
        per = workloads or {}
        return {s: self.cost.stage_latency(self.model_for(s), s, c, per.get(s, workload)).total
                * self.residual(s, c) for s, c in choices.items()}

    def step_seconds(self, seconds: Mapping[str, float], plan, overlapped: bool | None = None,
                     sync_s: float = 0.0) -> float:
        """Step latency from per-stage seconds: the critical path of the topology's overlap graph."""
        return critical_path(seconds, self.topology.edges(self.placed(plan), overlapped)) + sync_s

    def latency(self, plan, choices: Mapping[str, StageChoice], workload: Workload,
                overlapped: bool | None = None) -> float:
        """Predicted step latency of ``plan`` running ``choices`` on ``workload``."""
        return self.step_seconds(self.stage_seconds(choices, workload), plan, overlapped)

    def features(self, choices: Mapping[str, StageChoice], workload: Workload):
        """The step's coefficients on the cost model's parameters (every stage on the step's path)."""
        return sum(self.cost.features(self.model_for(s), s, c, workload) for s, c in choices.items())

    def gain_sd(self, current_features, target: Mapping[str, StageChoice], workload: Workload) -> float:
        """Standard deviation (s/step) of the predicted gain of ``target``'s choices over the current plan's
        (``current_features``: :meth:`features` of its choices, computed once for all candidates): the cost
        model's covariance on the difference of their features (what both run alike cancels), plus
        ``EXTRAPOLATION_SD`` of a stage's seconds per doubling of tp, pp or ep from the layouts it has run."""
        known = {s: c for s, c in target.items() if self._remembered(s, c)}
        diff = current_features - self.features({s: c for s, c in target.items() if s not in known}, workload)
        noise = sum((NOISE_FLOOR * self.cost.stage_latency(self.model_for(s), s, c, workload).total
                     * self.residual(s, c)) ** 2 for s, c in known.items())
        far = {s: d for s, c in target.items() if s not in known and (d := self.layout_distance(s, c)) > 0}
        unmeasured = sum((EXTRAPOLATION_SD * d * self.cost.stage_latency(self.model_for(s), s, target[s],
                                                                          workload).total) ** 2
                         for s, d in far.items())
        return math.sqrt(max(0.0, self.cost.variance(diff)) + noise + unmeasured)

    @property
    def measured_layouts(self) -> dict[str, set[tuple[int, int, int]]]:
        """Model-stage -> the (tp, pp, ep) layouts the job has measured it on (a copy)."""
        return {s: set(v) for s, v in self._layouts.items()}

    def layout_distance(self, stage: str, choice: StageChoice) -> float:
        """Doublings of tp, pp and ep from ``choice`` to the nearest layout the job has measured ``stage`` on (0
        when it has measured none: the prior's uncertainty covers an unmeasured stage)."""
        return self._distance(stage, choice.tp, choice.pp, choice.ep)

    def all_measured(self, choices: Mapping[str, StageChoice]) -> bool:
        """Whether every model-stage of ``choices`` runs at a layout the job measured it on (or one it has not
        measured at all): then no option of that plan is penalised by :meth:`risk_adjusted`, and a search over
        the re-ranked options finds it again."""
        return all(self.layout_distance(s, c) == 0 for s, c in choices.items())

    def _distance(self, stage: str, tp: int, pp: int, ep: int = 1) -> float:
        seen = self._layouts.get(stage)
        if not seen:
            return 0.0
        return min(abs(math.log2(tp / t)) + abs(math.log2(pp / p)) + abs(math.log2(ep / e)) for t, p, e in seen)

    def _distances(self, stage: str, raw: np.ndarray) -> np.ndarray:
        """:meth:`layout_distance` of each option row (``StageOptions.table``: tp, pp first, ep last) for ``stage``."""
        unique, index = np.unique(raw[:, [0, 1, 5]], axis=0, return_inverse=True)
        return np.array([self._distance(stage, int(tp), int(pp), int(ep))
                         for tp, pp, ep in unique])[index.reshape(-1)]

    def risk_adjusted(self, options: Mapping[str, StageOptions], z: float) -> dict[str, StageOptions]:
        """``options`` (a planning problem's, per unit model-stage) ranked by their seconds plus ``z`` times the
        extrapolation sd of their layout: ``EXTRAPOLATION_SD`` of the seconds of the model-stage, and of each
        rider, per doubling of tp, pp or ep from the nearest layout the job measured it on (summed, not added in
        quadrature: a conservative penalty for ranking). A search over them finds the plan that is fast by
        what the job has measured rather than by what the fit extrapolates to; the options' seconds are
        replaced by these scores, so price what it picks again. Unchanged before anything was measured."""
        out = {}
        for stage, o in options.items():
            if not len(o) or not self._layouts:
                out[stage] = o
                continue
            own = o.latency - sum((r.latency for r in o.riders), np.zeros(len(o)))
            sd = own * self._distances(stage, o.table) + sum((r.latency * self._distances(r.stage, o.table)
                                                            for r in o.riders), np.zeros(len(o)))
            out[stage] = o.ranked_by(o.latency + z * EXTRAPOLATION_SD * sd)
        return out

    def residual(self, stage: str, choice: StageChoice) -> float:
        """Measured / predicted seconds (median) of a call the job ran and whose measurements have left the
        calibration window; 1 for the calls in the window (the fit prices them) and for calls never run."""
        key = (stage, choice)
        if self._ratios_of is not self.cost:
            self._ratios.clear()
            self._ratios_of = self.cost
        if key not in self._ratios:
            self._ratios[key] = statistics.median(
                m.seconds / self.cost.stage_latency(m.model, m.stage, m.choice, m.workload).total
                for m in self.memory[key]) if self._remembered(stage, choice) else 1.0
        return self._ratios[key]

    def _remembered(self, stage: str, choice: StageChoice) -> bool:
        """Run before, but not in the calibration window."""
        return (stage, choice) in self.memory and (stage, choice) not in self._window_keys

    # ------------------------------------------------------------------------------------- memory
    def placed(self, plan) -> dict[str, tuple[int, ...]]:
        """Every priced model-stage -> the device ids it runs on (a rider: its host's)."""
        return self.topology.placed(plan)

    def device_bytes(self, plan, choices: Mapping[str, StageChoice], workload: Workload,
                     workloads: Mapping[str, Workload] | None = None) -> dict[int, float]:
        """Predicted peak bytes per device (``Topology.device_bytes`` of the cost model's stage memory), LoRA's
        frozen base counted once per device among the units that hold it identically (:meth:`shared_base`)."""
        per = workloads or {}
        return self.topology.device_bytes(plan, lambda s: tuple(self.cost.stage_memory(
            self.model_for(s), s, choices[s], per.get(s, workload))),
            shared=self.shared_base(choices) if self.share_base else None)

    def shared_base(self, choices: Mapping[str, StageChoice]):
        """``Topology.device_bytes``'s ``shared``: a stage -> (key, its frozen base's bytes per device), or None
        where it holds none (no LoRA, a reward model). The key is what the units holding one copy must have in
        common besides the replica: the share group (``costs.memory.share_group``: the actor's base, which a
        critic whose trunk is the actor's holds too), the network, the layout (tp, pp, ep) and the dtype."""
        def shared(stage: str):
            c = choices[stage]
            return frozen_base_key(self.model_for(stage), stage, c.tp, c.pp, c.ep)

        return shared

    def peak_bytes(self, plan, choices: Mapping[str, StageChoice], workload: Workload,
                   workloads: Mapping[str, Workload] | None = None) -> float:
        """The busiest device's predicted peak bytes."""
        return max(self.device_bytes(plan, choices, workload, workloads).values())

    def trigger_bytes(self, capacity: float) -> float:
        """Predicted peak per device above which the current plan must move (the memory trigger): halfway
        between what a new plan may fill and the device's ``capacity``. Plans are made to fill at most
        ``usable_bytes``; growing lengths use the other half of the headroom before a move is forced, and
        the last half stays for prediction error."""
        return (self.usable_bytes + capacity) / 2

    def fits(self, plan, choices: Mapping[str, StageChoice], workload: Workload) -> bool:
        return self.peak_bytes(plan, choices, workload) <= self.usable_bytes

    # --------------------------------------------------------------------------------- transitions
    def movement_seconds(self, graph) -> float:
        """A transition graph's predicted data movement: its critical path at the cost model's link times."""
        from nereus_jax.elastic.graph import transition_seconds  # graphs hold device arrays' specs: JAX

        return transition_seconds(graph, lambda link, n: self.cost.transfer_seconds(n, link),
                                  self.hardware.devices_per_node)

    # --------------------------------------------------------------------------------- calibration
    def calibrate(self, measurements: Iterable[Measurement]) -> None:
        """Adds one step's measured stage seconds to the window and refits the efficiencies to the window."""
        self.remember(measurements)
        self.cost.observe([m for step in self.window for m in step])
        self._ratios.clear()

    def remember(self, measurements: Iterable[Measurement]) -> None:
        """Adds one step's measurements to the window (without a refit) and to the per-layout memory."""
        step = list(measurements)
        self.window.append(step)
        for m in step:
            self.memory.setdefault((m.stage, m.choice), collections.deque(maxlen=REMEMBERED)).append(m)
            self._layouts.setdefault(m.stage, set()).add((m.choice.tp, m.choice.pp, m.choice.ep))
        self._window_keys = {(m.stage, m.choice) for step in self.window for m in step}
        self._ratios.clear()

    def measurements(self, choices: Mapping[str, StageChoice], workload: Workload,
                     seconds: Mapping[str, float]) -> list[Measurement]:
        """One step's measured seconds as calibration data (stages that did not run are left out)."""
        return [Measurement(self.model_for(s), s, c, workload, seconds[s])
                for s, c in choices.items() if seconds.get(s, 0) > 0]


def _stage_plan(plan, stage: str):
    for ms, sp in plan.items():
        if str(ms) == stage:
            return sp
    raise KeyError(f"the plan has no model-stage {stage}")
