"""Runs a TransitionGraph on real arrays: the EMUs of the old plan in, the EMUs of the new plan out.

Primitives map to JAX as follows:

* Split / Merge / Relayout / Derive: a jitted identity (kv-head re-repetition and, for Derive, the cast
  to the target dtypes inside) from one sharding to another on the SAME device list, donating its input
  (not Derive's, and not the last copy of a model-stage's state, which stays until its successor exists).
  Pieces are read out of, and put together into, the big array zero-copy.
* Extend / Offload / Onload: one ``jax.device_put`` of the whole unit to the same layout on other
  devices or another memory kind: the per-shard fast path, shards already in place reused.
* Destroy: the unit's own buffers are deleted at once (not those handed zero-copy to another unit), so
  memory goes even if the caller still holds old EMUs. The same holds for every unit a step frees; a
  donated input is deleted where XLA declined it (XLA consumes only the buffers an output can alias).

Steps are dispatched in the graph's order as soon as the steps they depend on have finished and the
ledger has room under the caps (and under ``extra_budget``, the bytes above the larger of the old and
new plan's footprint). JAX dispatch is asynchronous, so independent primitives run together; a step's
releases are booked when its outputs are ready. With ``checksums`` every unit a step makes is checked
against its model-stage's state (taken before anything moves) when it is ready, before the step frees
its inputs. Whatever fails in a run (a primitive, a checksum, taking the reference checksums), the steps
in flight finish without freeing anything and :class:`TransitionFailed` carries the surviving units (at
least one complete copy of every model-stage, since no step frees the last copy of anything before its
checked replacement exists) and a plan describing them. Only a graph and units that do not match raise
ValueError, before anything runs.

    executor = TransitionExecutor(checksums=True)
    new_units = executor.run(graph, {ms: [emu, ...], ...})
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, SingleDeviceSharding

from nereus_jax.model_stage import ModelStage
from nereus_jax.sharding import device_index, make_mesh

from .emu import EMU, leaves_checksum, regroup_optimizer, shards_by_device, stage_checksum, view
from .factor import common_layout, factor_mesh_devices, sub_replicas
from .graph import TransitionGraph
from .ledger import CapExceeded, Ledger
from .measured import cross_check, local_usage, measure
from .plan import DEVICE, ExecutionPlan, StagePlan
from .primitives import DERIVE, DESTROY, MERGE, REGROUPS, RELAYOUT, SPLIT, Step, Unit
from .shared_base import base_keys, held_buffers

DONATING = (SPLIT, MERGE, RELAYOUT)  # may donate their inputs to XLA (when another copy of the state exists)


class InjectedFailure(RuntimeError):
    """Raised by ``fail_at`` (tests): a primitive that fails before it runs."""


class TransitionFailed(RuntimeError):
    """A transition stopped at ``step`` (None: before the first); ``units`` / ``plan`` describe the intact
    state left behind."""

    def __init__(self, message: str, step: Step | None, units: dict[ModelStage, list[EMU]], plan: ExecutionPlan):
        super().__init__(message)
        self.step, self.units, self.plan = step, units, plan


class ChecksumMismatch(RuntimeError):
    """A unit that does not hold its model-stage's state bit for bit."""


class TransitionExecutor:
    """Executes transition graphs. ``checksums``: verify every new unit against its source state;
    ``extra_budget``: bytes the transition may hold above max(old, new footprint) at once ("unit" = the
    graph's largest unit, None = only the caps); ``max_in_flight``: dispatch limit (1 = sequential);
    ``verify_ledger``: compare the ledger with the arrays' shardings whenever nothing is in flight;
    ``fail_at``: step id (or predicate) at which to raise InjectedFailure, for tests; ``tamper``: called
    with each finished step and its new units ({uid: EMU}, which it may change) before they are checked and
    the step's inputs freed, for fault-injection tests; ``monitor``: called as ``monitor(event, step, ledger)``
    right after a step is dispatched (event "dispatched", its bytes acquired) and after it completed
    (event "completed", its inputs freed and its bytes released), e.g. to compare memory with the ledger."""

    def __init__(self, *, checksums: bool = False, extra_budget: int | str | None = "unit",
                 max_in_flight: int | None = None, verify_ledger: bool = False,
                 fail_at: int | Callable[[Step], bool] | None = None,
                 tamper: Callable[[Step, dict[int, EMU]], None] | None = None,
                 monitor: Callable[[str, Step, Ledger], None] | None = None):
        self.checksums, self.extra_budget = checksums, extra_budget
        self.max_in_flight, self.verify_ledger, self.fail_at = max_in_flight, verify_ledger, fail_at
        self.tamper, self.monitor = tamper, monitor
        self.ledger: Ledger | None = None
        self.trace: list[tuple[int, str, float, float]] = []  # (step id, op, dispatched, finished) seconds
        self.peak_extra_bytes = 0
        self.memory_check: dict[int, tuple[int, int]] = {}  # GPU: device -> (ledger, memory_stats) bytes
        self.reused_bytes = 0  # frozen base bytes the last run took from units holding them instead of moving

    def run(self, graph: TransitionGraph, units: Mapping[ModelStage, Sequence[EMU]],
            keep: Iterable[EMU] = (), share: Mapping[ModelStage, str] | None = None) -> dict[ModelStage, list[EMU]]:
        """Runs ``graph`` on ``units`` (per model-stage, in the old plan's replica order); returns the new
        plan's units (in its replica order). The input EMUs must not be used afterwards. ``keep``: units outside
        the graph that may share buffers with its units (LoRA's frozen base, ``elastic/shared_base.py``); no
        buffer they hold is deleted or donated, nor one that another live unit of the run still holds. ``share``
        (LoRA: model-stage -> share group, ``shared_base.share_groups``): a new unit of the target plan takes each
        frozen base leaf that a unit of its group already holds alike (in ``keep``, among the units the graph
        starts from, or made earlier in the run) instead of moving it, so the base moves once per placement
        (``reused_bytes`` counts what was not moved). Raises
        ValueError (nothing touched) when ``units`` are not the graph's old plan, TransitionFailed on any other
        error."""
        run = _Run(self, graph, units, keep, share)
        try:
            run.execute()
        except Exception as error:
            step = run.failed or run.current
            run.settle()
            survivors, plan = run.survivors()
            where = "before its first step" if step is None else f"at step s{step.sid} ({step.op} {step.stage})"
            raise TransitionFailed(f"transition failed {where}: {type(error).__name__}: {error}; every "
                                   "model-stage still has a complete copy (see .units / .plan)",
                                   step, survivors, plan) from error
        finally:
            self.ledger, self.trace, self.reused_bytes = run.ledger, run.trace, run.reused_bytes
            self.peak_extra_bytes = max(0, run.ledger.peak_total - run.base)
            self.memory_check = cross_check(run.ledger, run.devices.values())  # {} on CPU
        return {ms: [run.live[uid] for uid in uids] for ms, uids in graph.final.items()}


class _Run:
    """The state of one execution: live units by id, the ledger, the steps in flight."""

    def __init__(self, ex: TransitionExecutor, graph: TransitionGraph, units: Mapping[ModelStage, Sequence[EMU]],
                 keep: Iterable[EMU] = (), share: Mapping[ModelStage, str] | None = None):
        self.ex, self.graph = ex, graph
        self.live: dict[int, EMU] = {}
        self.devices: dict[int, jax.Device] = dict(enumerate(jax.devices()))  # plan ids: positions
        for ms, uids in graph.initial.items():
            emus = list(units[ms])
            if len(emus) != len(uids):
                raise ValueError(f"{ms}: the graph starts from {len(uids)} replicas, got {len(emus)} EMUs")
            for uid, emu in zip(uids, emus, strict=True):
                u = graph.units[uid]
                if (emu.device_ids, emu.layout, emu.memory) != (u.devices, u.layout, u.memory):
                    raise ValueError(f"{ms}: {emu} does not match the old plan's {u.label()}")
                self.live[uid] = emu
                self.devices.update({device_index(d): d for d in emu.devices})
        self.ledger = Ledger(graph.caps, graph.host_cap, initial=graph.initial_usage)
        device_total = lambda usage: sum(n for k, n in usage.items() if k >= 0)  # noqa: E731
        self.base = max(device_total(graph.initial_usage), device_total(graph.final_usage()))
        budget = ex.extra_budget
        self.budget = graph.largest_unit_bytes if budget == "unit" else budget
        self.inflight: collections.deque[tuple[Step, dict[int, EMU], float]] = collections.deque()
        self.done: set[int] = set()
        self.donated: set[int] = set()  # steps that donated their inputs to XLA
        self.trace: list[tuple[int, str, float, float]] = []
        self.t0 = time.perf_counter()
        self.current: Step | None = None  # the step being dispatched
        self.failed: Step | None = None  # the step whose completion failed (it may precede ``current``)
        self.reference: dict[ModelStage, np.ndarray] = {}
        self.checked: set[int] = set()  # units whose checksum matched
        # buffers held outside the graph, and whether any buffer is held twice (LoRA's shared frozen base): only
        # then does a free or a donation look at what the other live units hold
        keep = list(keep)
        self.outside = held_buffers(keep)
        self.share = dict(share or {})
        self.shared = bool(self.outside) or bool(self.share) or (
            any(_lora(u.spec) for u in self.live.values()) and _any_shared(self.live.values()))
        self._buffers: dict[int, set] = {}  # uid -> its buffers (units never change)
        # LoRA: frozen base leaves a new unit may take instead of moving them (see TransitionExecutor.run)
        self.frozen: dict[tuple, jax.Array] = {}
        self.reused_bytes = 0
        if self.share:
            for emu in (*keep, *self.live.values()):
                self._offer(emu)

    # --------------------------------------------------------------------------------- main loop
    def execute(self) -> None:
        if self.ex.checksums:
            self.reference = self._reference_checksums()
        for step in self.graph.steps:
            self.current = step
            for dep in step.all_deps():
                while dep not in self.done:
                    self.complete_oldest()
            while self.inflight and not self._room(step):
                self.complete_oldest()
            if short := self.ledger.shortfall(step.acquire):
                raise CapExceeded(f"step s{step.sid} would exceed a cap by {short[1]} bytes (internal error)")
            fail = self.ex.fail_at
            if fail is not None and (fail(step) if callable(fail) else fail == step.sid):
                raise InjectedFailure(f"injected failure at step s{step.sid}")
            outputs = self._dispatch(step)
            self.ledger.acquire(step.acquire, f"s{step.sid} {step.op}", check=False)
            self.live.update(outputs)
            self.inflight.append((step, outputs, time.perf_counter() - self.t0))
            if self.ex.monitor is not None:
                self.ex.monitor("dispatched", step, self.ledger)
        self.drain()
        if self.ex.checksums:
            self._verify_checksums()

    def _room(self, step: Step) -> bool:
        if self.ledger.shortfall(step.acquire):
            return False
        limit = self.ex.max_in_flight
        if jax.process_count() > 1:  # one step at a time: every process then takes the same donation decisions
            limit = 1
        if limit is not None and len(self.inflight) >= limit:
            return False
        if self.budget is None:
            return True
        new = sum(n for k, n in step.acquire.items() if k >= 0)
        return self.ledger.total + new - self.base <= self.budget

    def complete_oldest(self) -> None:
        step, outputs, dispatched = self.inflight.popleft()
        try:
            jax.block_until_ready([u.leaves for u in outputs.values()])
            if self._across_processes(step):  # the sender frees nothing before every receiver has its copy
                multihost_utils.sync_global_devices(f"nereus transition step {step.sid}")
            if self.ex.tamper is not None:
                self.ex.tamper(step, outputs)
                self.live.update(outputs)
            if self.ex.checksums:
                self._check(outputs.values())
        except Exception:  # its outputs never came to be (or are wrong); what it donated is gone
            self.failed = self.failed or step
            for uid in (*outputs, *(step.frees if step.sid in self.donated else ())):
                self.live.pop(uid, None)
            raise
        for uid in step.frees:
            self._free(uid, step, outputs)
        self.ledger.release(step.release)
        self.done.add(step.sid)
        self.trace.append((step.sid, step.op, dispatched, time.perf_counter() - self.t0))
        if self.ex.verify_ledger and not self.inflight:
            self.check_ledger()
        if self.ex.monitor is not None:
            self.ex.monitor("completed", step, self.ledger)

    def _free(self, uid: int, step: Step, outputs: Mapping[int, EMU]) -> None:
        """Drops a unit ``step`` frees and deletes the buffers it owns now, so the memory goes even while
        the caller still holds the old EMUs (shards handed zero-copy to another unit stay). A donated
        input is deleted where XLA did not consume it: XLA takes a donated buffer only when an output can
        alias it (same size on the same device), and JAX leaves the others alive; one still referenced
        elsewhere (the caller's EMUs, the whole-state arrays replicas are views of) would outlive its
        release in the ledger. XLA may take some devices' buffers of an array and decline others' (one it
        cannot reuse, e.g. one with an external reference). Buffers an output of the step aliases are never
        deleted."""
        emu = self.live.pop(uid, None)
        if emu is None:
            return
        others = self._held_by_others() if self.shared else set()
        keep = set(self.graph.units[uid].handed)
        made: set[tuple[jax.Device, int]] | None = None
        for x in emu.leaves:
            if x.is_deleted():  # donated and consumed
                continue
            if made is None and (step.sid in self.donated or step.op in REGROUPS):  # regroups share parameters
                made = {(s.device, s.data.unsafe_buffer_pointer()) for u in outputs.values() for y in u.leaves
                        for s in y.addressable_shards}
            for shard in x.addressable_shards:
                if device_index(shard.device) in keep or shard.data.is_deleted():  # handed on, or consumed
                    continue
                if made and (shard.device, shard.data.unsafe_buffer_pointer()) in made:
                    continue
                if others and (shard.device, shard.data.unsafe_buffer_pointer()) in others:
                    continue  # another unit (or the caller's ``keep``) holds it too
                shard.data.delete()

    def _held_by_others(self, exclude: Sequence[int] = ()) -> set[tuple[jax.Device, int]]:
        """The buffers every live unit but ``exclude`` holds, and those held outside the graph."""
        out = set(self.outside)
        for uid in self.live:
            if uid not in exclude:
                out |= self._unit_buffers(uid)
        return out

    def _unit_buffers(self, uid: int) -> set[tuple[jax.Device, int]]:
        if uid not in self._buffers:
            self._buffers[uid] = held_buffers([self.live[uid]])
        return self._buffers[uid]

    def _shares_inputs(self, step: Step) -> bool:
        """Whether a buffer of ``step``'s inputs is held by another live unit or outside the graph (then XLA
        may not consume it: no donation)."""
        if not self.shared:
            return False
        others = self._held_by_others(step.inputs)
        return any(self._unit_buffers(u) & others for u in step.inputs)

    def drain(self) -> None:
        while self.inflight:
            self.complete_oldest()

    def settle(self) -> None:
        """After a failure: waits for the steps in flight and keeps the units they made (if they check out),
        but frees nothing more. A step may have been dispatched on the strength of a unit that a later step
        in flight frees (a Destroy of the unit the failed step was replacing, or the copy that let it donate
        its inputs); those frees never happen now, so that unit stays."""
        while self.inflight:
            step, outputs, _ = self.inflight.popleft()
            if step.sid in self.donated:  # XLA took its inputs, whether it finished or not
                for uid in step.frees:
                    self.live.pop(uid, None)
            try:
                jax.block_until_ready([u.leaves for u in outputs.values()])
                if self._across_processes(step):
                    multihost_utils.sync_global_devices(f"nereus transition step {step.sid}")
                if self.ex.checksums:
                    self._check(outputs.values())
            except Exception:
                for uid in outputs:
                    self.live.pop(uid, None)

    def check_ledger(self) -> None:
        measured = measure(x for u in self.live.values() for x in u.leaves)
        booked = local_usage({k: n for k, n in self.ledger.used.items() if n})
        assert measured == booked, f"ledger {booked} != live arrays {measured}"

    def _across_processes(self, step: Step) -> bool:
        """A step whose data crosses from one process's devices to another's (the same on every process)."""
        if jax.process_count() == 1:
            return False
        ids = {d for u in (*step.inputs, *step.outputs) for d in self.graph.units[u].devices}
        return len({self.devices[d].process_index for d in ids}) > 1

    # -------------------------------------------------------------------------------- primitives
    def _dispatch(self, step: Step) -> dict[int, EMU]:
        g = self.graph
        if step.op == DESTROY:
            return {}
        outs = [g.units[u] for u in step.outputs]
        donate = step.op in DONATING and self._another_copy(step) and not self._shares_inputs(step)
        if donate:
            self.donated.add(step.sid)
        inputs = [self.live[u] for u in step.inputs]
        held = self._held_base(step, outs) if self.share else {}
        if not held:
            made = self._op(step, inputs, outs, donate)
        else:  # the op moves the rest; the frozen leaves a unit of the group already holds alike are taken as they are
            rest = tuple(i for i in range(len(outs[0].spec.leaves)) if i not in held[outs[0].uid])
            sub = [dataclasses.replace(u, leaves=[u.leaves[i] for i in rest], spec=_subset(u.spec, rest))
                   for u in inputs]
            made = self._op(step, sub, [dataclasses.replace(t, spec=_subset(t.spec, rest)) for t in outs], donate)
            for t in outs:
                leaves = dict(zip(rest, made[t.uid].leaves, strict=True)) | held[t.uid]
                made[t.uid] = dataclasses.replace(made[t.uid], leaves=[leaves[i] for i in range(len(leaves))],
                                                  spec=t.spec)
                self.reused_bytes += sum(x.nbytes for x in held[t.uid].values())
        if self.share:
            for emu in made.values():
                self._offer(emu)
        return made

    def _op(self, step: Step, inputs: list[EMU], outs: list[Unit], donate: bool) -> dict[int, EMU]:
        if step.op == RELAYOUT or (step.op == DERIVE and step.modes is None):
            return self._reshard(inputs[0], outs[0], donate)
        if step.op in (SPLIT, DERIVE):
            return self._split(inputs[0], outs, step.modes, donate)
        if step.op == MERGE:
            return self._merge(inputs, outs[0], step.modes, donate)
        if step.op in REGROUPS:
            return self._regroup(inputs, outs)
        return self._copy(inputs[0], outs[0])

    # ------------------------------------------------------------------------- LoRA's shared frozen base
    def _base_keys(self, stage: ModelStage, devices: tuple[int, ...], layout, spec, memory: str):
        """``shared_base.base_keys`` of a unit of ``stage`` at this place ([] outside a share group or memory)."""
        group = self.share.get(stage)
        if group is None or memory != DEVICE or not hasattr(spec, "n_params"):
            return []
        return base_keys(group, devices, layout, spec)

    def _offer(self, emu: EMU) -> None:
        """Makes ``emu``'s frozen leaves available to the units the run makes after it (the first holder stays;
        a holder's deleted buffers are skipped when taken)."""
        for i, key in self._base_keys(emu.stage, emu.device_ids, emu.layout, emu.spec, emu.memory):
            self.frozen.setdefault(key, emu.leaves[i])

    def _held_base(self, step: Step, outs: list[Unit]) -> dict[int, dict[int, jax.Array]]:
        """Per output of ``step``, the frozen leaves (index -> array) that a unit of its group already holds alike,
        the same indices for every output (else {}: the op moves everything). Any unit may take them, a final one
        or one a later step reads on: the content is the same, and the buffers outlive every unit holding them
        (no free deletes and no step donates a buffer another live unit holds). Not for a regroup (it copies no
        parameters)."""
        if step.op in REGROUPS:
            return {}
        held = {}
        for t in outs:
            found = {}
            for i, key in self._base_keys(t.stage, t.devices, t.layout, t.spec, t.memory):
                x = self.frozen.get(key)
                if x is not None and not x.is_deleted():
                    found[i] = x
            held[t.uid] = found
        common = set.intersection(*(set(f) for f in held.values())) if held else set()
        if not common:
            return {}
        return {uid: {i: f[i] for i in common} for uid, f in held.items()}

    def _regroup(self, units: list[EMU], targets: list[Unit]) -> dict[int, EMU]:
        """Gather / Scatter: every replica's optimizer state whole, or split into their blocks."""
        assert [u.device_ids for u in units] == [t.devices for t in targets]
        out = regroup_optimizer(units, targets[0].spec)
        return {t.uid: u for t, u in zip(targets, out, strict=True)}

    def _copy(self, src: EMU, t: Unit) -> dict[int, EMU]:
        """Extend / Offload / Onload: the same layout on other devices or in another memory kind."""
        devices = self._devs(t.devices)
        shardings = t.spec.shardings(make_mesh(devices, t.layout), t.memory)
        if set(src.devices) != set(devices) or src.devices == devices or jax.process_count() > 1:
            leaves = jax.device_put(src.leaves, shardings)  # per-shard copies, shards in place reused
        else:  # same devices, other order: JAX would reorder (and refuses to change memory kind meanwhile)
            targets = [SingleDeviceSharding(d, memory_kind=t.memory) for d in devices]
            leaves = []
            for x, sharding in zip(src.leaves, shardings, strict=True):
                by_device = shards_by_device(x)
                moved = jax.device_put([by_device[d] for d in src.devices], targets)
                leaves.append(jax.make_array_from_single_device_arrays(x.shape, sharding, moved))
        return {t.uid: EMU(t.stage, t.layout, devices, leaves, t.spec, t.memory, src.shard)}

    def _devs(self, ids: Sequence[int]) -> tuple[jax.Device, ...]:
        return tuple(self.devices[i] for i in ids)

    def _reshard(self, src: EMU, t: Unit, donate: bool) -> dict[int, EMU]:
        """Old layout -> new layout on the same device list, one jitted program (Split + Merge fused)."""
        assert src.device_ids == t.devices
        spec = t.spec
        convert = spec.converter(src.spec.repeat(src.layout), spec.repeat(t.layout),
                                 source=None if spec is src.spec else src.spec)
        out = _relayout(convert, tuple(spec.shardings(make_mesh(src.devices, t.layout))), donate)(src.leaves)
        return {t.uid: EMU(t.stage, t.layout, src.devices, list(out), spec, DEVICE)}

    def _split(self, src: EMU, pieces: list[Unit], modes, donate: bool) -> dict[int, EMU]:
        small, spec = pieces[0].layout, pieces[0].spec
        arr, names = factor_mesh_devices(src.devices, src.layout, small, modes)
        convert = spec.converter(src.spec.repeat(src.layout), spec.repeat(small),
                                 source=None if spec is src.spec else src.spec)
        out_shardings = tuple(spec.shardings(Mesh(arr, names)))
        big = _relayout(convert, out_shardings, donate)(src.leaves)
        shards = [shards_by_device(x) for x in big]
        del big
        assert [p.devices for p in pieces] == sub_replicas(src.device_ids, src.layout, small, modes)
        out = {}
        for p in pieces:
            devices = self._devs(p.devices)
            shardings = spec.shardings(make_mesh(devices, small))
            leaves = [view(s, a.shape, sh, devices, a.dtype)
                      for s, a, sh in zip(shards, spec.abstract(small), shardings, strict=True)]
            out[p.uid] = EMU(p.stage, small, devices, leaves, spec, DEVICE)
        return out

    def _another_copy(self, step: Step) -> bool:
        """Whether a complete copy of the stage's state outlives this step even if it fails midway: then
        its inputs may be donated (XLA frees them as it finishes; otherwise they are freed after it). With
        checksums, units still being made do not count (their checksum may fail); without, they do (only
        this step failing together with theirs could lose the state, and donating saves a copy's time)."""
        busy = set(step.inputs).union(*(s.frees for s, _, _ in self.inflight))
        if self.ex.checksums:
            busy = busy.union(*(outputs for _, outputs, _ in self.inflight))
        # a block of an optimizer split over replicas is no copy of the state on its own
        return any(e.stage == step.stage and e.spec.shards == 1 and uid not in busy for uid, e in self.live.items())

    def _merge(self, parts: list[EMU], t: Unit, modes, donate: bool) -> dict[int, EMU]:
        small, spec = parts[0].layout, t.spec
        devices = self._devs(t.devices)
        assert [p.device_ids for p in parts] == sub_replicas(t.devices, t.layout, small, modes)
        assert common_layout(small, t.layout) == small
        arr, names = factor_mesh_devices(devices, t.layout, small, modes)
        in_shardings = spec.shardings(Mesh(arr, names))
        flat = [d for d in arr.reshape(-1)]
        leaves = []
        for i, (a, sh) in enumerate(zip(spec.abstract(small), in_shardings, strict=True)):
            shards: dict[jax.Device, jax.Array] = {}
            for p in parts:
                shards.update(shards_by_device(p.leaves[i]))
            leaves.append(view(shards, a.shape, sh, flat, a.dtype))
        convert = spec.converter(spec.repeat(small), spec.repeat(t.layout))
        out_shardings = tuple(spec.shardings(make_mesh(devices, t.layout)))
        out = _relayout(convert, out_shardings, donate)(leaves)
        del leaves
        return {t.uid: EMU(t.stage, t.layout, devices, list(out), spec, DEVICE)}

    # --------------------------------------------------------------------------------- checksums
    def _reference_checksums(self) -> dict[ModelStage, np.ndarray]:
        """Per model-stage that gets new units, the checksum they must have (taken before anything moves);
        a derived stage's is its source's parameters cast on the source's devices, by the same convert."""
        g, ref = self.graph, {}
        made = {g.units[uid].stage for step in g.steps for uid in step.outputs}
        for ms in made | {ms for ms, uids in g.final.items() if uids != g.initial.get(ms)}:
            if ms in g.derived:
                src = self.live[g.initial[g.derived[ms]][0]]
                spec = g.units[g.final[ms][0]].spec
                leaves = src.leaves[: spec.n_params]
                if src.memory != DEVICE:
                    leaves = jax.device_put(leaves, src.spec.shardings(src.mesh, DEVICE)[: spec.n_params])
                cast = _cast(tuple(leaf.dtype for leaf in spec.leaves))(leaves)
                ref[ms] = leaves_checksum(cast, src.mesh, src.spec.leaves[: spec.n_params], src.spec.repeat(src.layout))
            else:
                ref[ms] = stage_checksum([self.live[uid] for uid in g.initial[ms]])
        return ref

    def _check(self, units) -> None:
        """Raises ChecksumMismatch unless every unit holds its model-stage's reference state bit for bit (the
        blocks of an optimizer split over replicas: all of them together)."""
        units = list(units)
        blocks = [e for e in units if e.spec.shards > 1]
        for emu in units:
            if emu.spec.shards == 1 and not np.array_equal(emu.checksum(), self.reference[emu.stage]):
                raise ChecksumMismatch(f"{emu} does not match {emu.stage}'s source state")
        if blocks:
            group = sorted(blocks, key=lambda e: e.shard)
            if [e.shard for e in group] == list(range(group[0].spec.shards)) and \
                    not np.array_equal(stage_checksum(group), self.reference[group[0].stage]):
                raise ChecksumMismatch(f"{group} do not hold {group[0].stage}'s source state together")
        self.checked.update(id(e) for e in units)

    def _verify_checksums(self) -> None:
        """The final units not checked on the way (kept old units of a changed model-stage)."""
        for ms, uids in self.graph.final.items():
            if ms in self.reference:
                units = [self.live[uid] for uid in uids]
                if any(id(u) not in self.checked for u in units):
                    self._check(units)

    # ---------------------------------------------------------------------------------- recovery
    def survivors(self) -> tuple[dict[ModelStage, list[EMU]], ExecutionPlan]:
        """Per model-stage, one consistent set of live units (same layout and memory, disjoint devices:
        device memory first, then the new layout, then the old); the rest are dropped, which never loses
        state since every unit is a complete replica. The plan describes what is left."""
        by_stage: dict[ModelStage, list[EMU]] = {}
        for uid in sorted(self.live):
            emu = self.live[uid]
            by_stage.setdefault(emu.stage, []).append(emu)
        keep, plan = {}, {}
        for ms, emus in by_stage.items():
            groups: dict[tuple, list[EMU]] = {}
            for e in emus:
                groups.setdefault((e.layout, e.memory, e.spec.shards), []).append(e)
            # blocks of an optimizer split over replicas are a copy only all together (one of each block)
            groups = {k: es for k, es in groups.items() if k[2] == 1 or _all_blocks(es)}
            target, source = self.graph.new_plan[ms].layout, self.graph.old_plan[ms].layout
            best = max(groups.values(), key=lambda es: (es[0].memory == DEVICE, es[0].layout == target,
                                                         es[0].layout == source, len(es)))
            chosen, used = [], set()
            for e in sorted(best, key=lambda e: e.shard) if best[0].spec.shards > 1 else best:
                if not used & set(e.device_ids) and (e.spec.shards == 1 or e.shard == len(chosen)):
                    chosen.append(e)
                    used |= set(e.device_ids)
            if best[0].spec.shards == 1 and best[0].spec.for_dp(len(chosen)) is not best[0].spec \
                    and best[0].memory == DEVICE:
                chosen = regroup_optimizer(chosen, best[0].spec.for_dp(len(chosen)))  # the form a plan of dp expects
            keep[ms] = chosen
            plan[ms] = StagePlan(chosen[0].layout, tuple(e.device_ids for e in chosen), chosen[0].memory)
        self.live = {}
        self.ledger = Ledger(self.graph.caps, self.graph.host_cap,
                             initial=measure(x for es in keep.values() for e in es for x in e.leaves))
        return keep, ExecutionPlan(plan)


def _all_blocks(units: Sequence[EMU]) -> bool:
    """Whether ``units`` hold every block of an optimizer split over replicas, on disjoint devices."""
    by_block = {e.shard: e for e in units}
    devices = [d for e in by_block.values() for d in e.device_ids]
    return sorted(by_block) == list(range(units[0].spec.shards)) and len(devices) == len(set(devices))


@functools.lru_cache(maxsize=64)
def _cast(dtypes: tuple[np.dtype, ...]) -> Callable:
    """Leaves cast to ``dtypes`` where they differ, in place (the Derive's convert, for its reference)."""
    return jax.jit(lambda leaves: [x.astype(d) if x.dtype != d else x for x, d in zip(leaves, dtypes, strict=True)])


@functools.lru_cache(maxsize=1024)
def _jitted(convert: Callable, in_shardings: tuple, out_shardings: tuple, donate: bool) -> Callable:
    """The converter with both ends of every leaf pinned inside it: one reshard each, by collectives and
    copies only (see ``StateSpec.converter``)."""
    pinned = functools.partial(convert, shardings=out_shardings, sources=in_shardings)
    return jax.jit(pinned, out_shardings=list(out_shardings), donate_argnums=0 if donate else ())


def _relayout(convert: Callable, out_shardings: tuple, donate: bool) -> Callable:
    """The jitted identity (plus kv re-repetition / cast) to ``out_shardings``, compiled once per signature."""

    def call(leaves):
        leaves = list(leaves)
        fn = _jitted(convert, tuple(x.sharding for x in leaves), out_shardings, donate)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
            return fn(leaves)

    return call


@functools.lru_cache(maxsize=256)
def _subset(spec, indices: tuple[int, ...]):
    """``spec`` restricted to the leaves at ``indices`` (cached: the ops' converters and programs stay the same)."""
    return spec.subset(indices)


def _lora(spec) -> bool:
    """Whether ``spec`` is a LoRA model's state (the only state whose buffers units of a run may share)."""
    model = getattr(spec, "model", None)
    return bool(model is not None and model.lora_rank)


def _any_shared(units: Iterable[EMU]) -> bool:
    """Whether two of ``units`` hold a buffer in common."""
    seen: set = set()
    for u in units:
        mine = held_buffers([u])
        if mine & seen:
            return True
        seen |= mine
    return False
