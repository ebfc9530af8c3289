"""The global transition graph: every model-stage's change from an old plan to a new one, as one
scheduled DAG of Split / Merge / Extend / Destroy / Offload / Onload (and Derive for weight sync).

Built from metadata only (plans and per-stage byte specs, no arrays), so it can be timed at 1,024 GPUs
and driven by a simulator. Per model-stage the recipe is compile.compile_stage; across model-stages the
scheduler (schedule.Scheduler) orders steps release-before-acquire with the generation -> inference ->
training tie-break under the per-device caps, adds resource edges and, when it must, offloads.

    graph = TransitionGraph.build(old_plan, new_plan, specs, caps=2 * 2**30)
    print(graph)                         # one line per step: op, model-stage, units, bytes
    seconds = transition_seconds(graph, lambda link, n: cost.transfer_seconds(n, link), devices_per_node=8)
    TransitionExecutor().run(graph, emus)

``build`` raises :class:`Infeasible` (naming the device and the bytes short) before anything moves.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Mapping
from typing import Any

from nereus_jax.layout import LayoutError
from nereus_jax.model_stage import ModelStage

from .ledger import Ledger, describe_key, fmt_bytes, key
from .plan import DEVICE, ExecutionPlan
from .primitives import COPIES, DESTROY, OFFLOAD, ONLOAD, Builder, Step, Unit, for_dp
from .recipe import compile_stage
from .schedule import Infeasible, Scheduler, replay_peak

LinkSeconds = Callable[[str, float], float]  # (link type, bytes per device) -> seconds


class TransitionError(ValueError):
    """A plan pair that no transition can connect (a model-stage appears or vanishes, a bad layout)."""


class TransitionGraph:
    """A scheduled transition: ``steps`` in start order, ``units`` by id, ``initial`` / ``final`` unit
    ids per model-stage (in the old / new plan's replica order), the caps it was scheduled under."""

    def __init__(self, old_plan: ExecutionPlan, new_plan: ExecutionPlan, b: Builder,
                 initial: dict[ModelStage, list[Unit]], final: dict[ModelStage, list[Unit]],
                 caps: int | Mapping[int, int] | None, host_cap: int | None, initial_usage: dict[int, int]):
        self.old_plan, self.new_plan = old_plan, new_plan
        self.units = b.units
        self._builder = b
        self.initial = {ms: [u.uid for u in us] for ms, us in initial.items()}
        self.final = {ms: [u.uid for u in us] for ms, us in final.items()}
        self.caps, self.host_cap = caps, host_cap
        self.initial_usage = initial_usage
        self.steps: list[Step] = list(b.steps)
        self._peak: dict[int, int] | None = None
        self.makespan_s = 0.0
        self.derived: dict[ModelStage, ModelStage] = {}  # weight sync: target stage -> source stage

    # ------------------------------------------------------------------------------------ building
    @classmethod
    def build(cls, old_plan: ExecutionPlan, new_plan: ExecutionPlan, units: Mapping[ModelStage, Any], *,
              caps: int | Mapping[int, int] | None = None, host_cap: int | None = None,
              allow_offload: bool = True, bandwidth: float = 10e9, latency: float = 1e-4) -> TransitionGraph:
        """The scheduled graph from ``old_plan`` to ``new_plan``. ``units``: model-stage -> its replica
        state spec (StateSpec, or ByteSpec for simulations); ``caps``: bytes per device (one number or
        per device id); ``host_cap``: all pinned host memory together."""
        with _gc_paused():
            return cls._build(old_plan, new_plan, units, caps, host_cap, allow_offload, bandwidth, latency)

    @classmethod
    def _build(cls, old_plan, new_plan, units, caps, host_cap, allow_offload, bandwidth, latency):
        if set(old_plan) != set(new_plan):
            gone, new = set(old_plan) - set(new_plan), set(new_plan) - set(old_plan)
            raise TransitionError(f"plans must hold the same model-stages: only old {sorted(map(str, gone))}, "
                                  f"only new {sorted(map(str, new))}")
        b = Builder()
        initial = {ms: [b.unit(ms, sp.layout, r, sp.memory, for_dp(units[ms], sp.dp)) for r in sp.replicas]
                   for ms, sp in old_plan.items()}
        final = {}
        for ms, sp in new_plan.items():
            _check_layouts(units[ms], ms, old_plan[ms].layout, sp.layout)
            final[ms] = initial[ms] if sp == old_plan[ms] else compile_stage(b, ms, initial[ms], sp, units[ms])
        return cls._scheduled(old_plan, new_plan, b, initial, final, caps, host_cap, allow_offload,
                              bandwidth, latency)

    @classmethod
    def weight_sync(cls, plan: ExecutionPlan, src: ModelStage, dst: ModelStage, units: Mapping[ModelStage, Any],
                    *, caps: int | Mapping[int, int] | None = None, host_cap: int | None = None,
                    bandwidth: float = 10e9, latency: float = 1e-4, keep_old: bool = False) -> TransitionGraph:
        """The per-step sync ``src`` (e.g. actor-train) -> ``dst`` (actor-gen) within ``plan``: the stale
        ``dst`` units are destroyed, fresh ones derived from ``src`` (cast to ``dst``'s dtypes).
        ``keep_old``: the stale ``dst`` units are outside the graph and stay alive (double buffering: an
        engine still decoding with them drops them itself); the graph starts with no ``dst`` units."""
        with _gc_paused():
            return cls._weight_sync(plan, src, dst, units, caps, host_cap, bandwidth, latency, keep_old)

    @classmethod
    def _weight_sync(cls, plan, src, dst, units, caps, host_cap, bandwidth, latency, keep_old=False):
        b = Builder()
        initial = {ms: [b.unit(ms, sp.layout, r, sp.memory, for_dp(units[ms], sp.dp)) for r in sp.replicas]
                   for ms, sp in plan.items() if ms == src or (ms == dst and not keep_old)}
        _check_layouts(units[dst], dst, plan[dst].layout)
        new_dst = compile_stage(b, dst, initial[src], plan[dst], units[dst], derive=True,
                                stale=() if keep_old else initial[dst])
        final = {src: initial[src], dst: new_dst}
        sub = ExecutionPlan({src: plan[src], dst: plan[dst]})
        g = cls._scheduled(sub, sub, b, initial, final, caps, host_cap, True, bandwidth, latency)
        g.derived = {dst: src}
        return g

    @classmethod
    def _scheduled(cls, old_plan, new_plan, b, initial, final, caps, host_cap, allow_offload, bandwidth,
                   latency) -> TransitionGraph:
        usage = _usage(u for us in initial.values() for u in us)
        ledger = Ledger(caps, host_cap)
        _check_fits(ledger, usage, "the old plan")
        _check_fits(ledger, _usage(u for us in final.values() for u in us), "the new plan")
        sim = Ledger(caps, host_cap, initial=usage)
        order = Scheduler(b, sim, final, allow_offload=allow_offload, bandwidth=bandwidth, latency=latency).run()
        g = cls(old_plan, new_plan, b, initial, final, caps, host_cap, usage)
        g.steps = [b.steps[i] for i in order]
        g.makespan_s = max((s.end for s in g.steps), default=0.0)
        return g

    # ------------------------------------------------------------------------------------- queries
    @property
    def predicted_peak(self) -> dict[int, int]:
        """Peak bytes per ledger key over the schedule (steps overlapping as simulated)."""
        if self._peak is None:
            self._peak = replay_peak(self.steps, self.initial_usage)
        return self._peak

    @property
    def largest_unit_bytes(self) -> int:
        """Bytes of the largest single unit (one replica of one model-stage, all its devices)."""
        return max(u.total_bytes for u in self.units.values())

    def is_acyclic(self) -> bool:
        """True when every dependency (data and resource) starts before its dependent in ``steps``."""
        seen: set[int] = set()
        for s in self.steps:
            if not s.all_deps() <= seen:
                return False
            seen.add(s.sid)
        return len(seen) == len(self._builder.steps)

    def final_usage(self) -> dict[int, int]:
        return _usage(self.units[u] for us in self.final.values() for u in us)

    def __len__(self) -> int:
        return len(self.steps)

    def __str__(self) -> str:
        peak = max((n for k, n in self.predicted_peak.items() if k >= 0), default=0)
        caps = Ledger(self.caps)
        cap = caps.default_cap or max(caps.caps.values(), default=0)
        head = (f"TransitionGraph: {len(self.steps)} steps over {len(self.final)} model-stages, predicted "
                f"{self.makespan_s * 1e3:.2f} ms, peak {fmt_bytes(peak)}/device"
                + (f" (cap {fmt_bytes(cap)})" if cap else ""))
        lines = [head, f"  {'step':>5} {'t(ms)':>8}  {'op':<9}{'model-stage':<14} {'reads':<28} makes  [bytes]"]
        for s in self.steps:
            reads = " ".join(self.units[u].label() for u in s.inputs) or "-"
            if s.frees and not s.inputs:
                reads = " ".join(self.units[u].label() for u in s.frees)
            makes = " ".join(self.units[u].label() for u in s.outputs) or "-"
            lines.append(f"  s{s.sid:<4} {s.start * 1e3:8.2f}  {s.op:<9}{str(s.stage):<14} {reads:<28} {makes}  "
                         f"[{_bytes_note(s)}]")
        return "\n".join(lines)


@contextlib.contextmanager
def _gc_paused():
    """Graphs are thousands of small objects without cycles to collect; the cyclic GC would rescan
    them (and the caller's heap) many times while they are built."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def plan_usage(plan: ExecutionPlan, units: Mapping[ModelStage, Any]) -> dict[int, int]:
    """Bytes per ledger key that ``plan``'s state occupies (device memory: the device id; host: ~id)."""
    out: dict[int, int] = {}
    for ms, sp in plan.items():
        n = for_dp(units[ms], sp.dp).bytes_per_device(sp.layout)
        for d in sp.devices:
            k = key(d, sp.memory)
            out[k] = out.get(k, 0) + n
    return out


def step_link(graph: TransitionGraph, step: Step, devices_per_node: int) -> str:
    """The link a primitive's bytes travel: "host" (Offload / Onload), "intra" (inside one node) or
    "inter" (a copy whose source and target ranks sit on different nodes, or a Split / Merge whose units
    span nodes)."""
    if step.op in (OFFLOAD, ONLOAD):
        return "host"
    if step.op in COPIES:
        src, dst = graph.units[step.inputs[0]], graph.units[step.outputs[0]]
        crossing = any(a // devices_per_node != b // devices_per_node
                       for a, b in zip(src.devices, dst.devices, strict=False))
        return "inter" if crossing else "intra"
    units = [graph.units[u] for u in (*step.inputs, *step.outputs)]
    nodes = {d // devices_per_node for u in units for d in u.devices}
    return "intra" if len(nodes) <= 1 else "inter"


def transition_seconds(graph: TransitionGraph, link_seconds: LinkSeconds, devices_per_node: int) -> float:
    """Predicted seconds of a scheduled transition: the critical path of ``graph`` (data and the
    scheduler's resource edges) with every primitive priced by ``link_seconds(link, bytes per device)``
    on its :func:`step_link`; a Destroy is free. The controller's price (a cost model's link times) and
    a simulator's ground truth (its own link times) both come from here."""
    end: dict[int, float] = {}
    for s in graph.steps:
        start = max((end[d] for d in s.all_deps() if d in end), default=0.0)
        if s.op == DESTROY:
            end[s.sid] = start
            continue
        nbytes = max(s.acquire.values(), default=0)
        end[s.sid] = start + link_seconds(step_link(graph, s, devices_per_node), float(nbytes))
    return max(end.values(), default=0.0)


def _bytes_note(s: Step) -> str:
    parts = []
    for sign, table in (("+", s.acquire), ("-", s.release)):
        if table:
            per = sorted(set(table.values()))
            where = "host " if min(table) < 0 else ""
            parts.append(f"{sign}{'/'.join(fmt_bytes(n) for n in per)} x{len(table)} {where}dev")
    return ", ".join(parts) or "0 B"


def _usage(units) -> dict[int, int]:
    out: dict[int, int] = {}
    get = out.get
    for u in units:
        n, host = u.nbytes, u.memory != DEVICE
        for d in u.devices:
            k = ~d if host else d
            out[k] = get(k, 0) + n
    return out


def _check_fits(ledger: Ledger, usage: dict[int, int], what: str) -> None:
    for k, n in sorted(usage.items()):
        if k >= 0 and n > ledger.cap(k):
            raise Infeasible(f"infeasible transition: {what} needs {fmt_bytes(n)} on {describe_key(k)}, "
                             f"{fmt_bytes(n - ledger.cap(k))} more than its cap {fmt_bytes(ledger.cap(k))}",
                             k, int(n - ledger.cap(k)))
    host = sum(n for k, n in usage.items() if k < 0)
    if ledger.host_cap is not None and host > ledger.host_cap:
        raise Infeasible(f"infeasible transition: {what} parks {fmt_bytes(host)} in host memory, "
                         f"{fmt_bytes(host - ledger.host_cap)} more than its cap", -1, host - ledger.host_cap)


def _check_layouts(spec: Any, ms: ModelStage, *layouts) -> None:
    for layout in layouts:
        try:
            spec.check(layout)
        except LayoutError as error:
            raise TransitionError(f"{ms}: {error}") from None


__all__ = ["DEVICE", "Infeasible", "LinkSeconds", "TransitionError", "TransitionGraph", "plan_usage", "step_link",
           "transition_seconds"]
