"""Greedy resource-constrained scheduling of a transition graph under per-device memory caps.

A discrete-event simulation: ready steps start in priority order (steps that release memory before
steps that acquire it; ties generation -> inference -> training, then creation order) whenever the
bytes they acquire fit under every cap; a running step's releases happen when it ends. A step that had
to wait gets a resource edge from the step whose release let it start; that step had already finished,
so it never depends on the waiting one and the graph stays acyclic. When nothing runs and nothing ready
fits, a unit on the short device is offloaded to pinned host memory (its copies then read the host copy,
its other readers get it onloaded back); if no unit can go, the pair is infeasible and
:class:`Infeasible` names the device and the bytes short. The start order it returns is feasible when
run one step at a time, which is what the executor falls back to. :func:`replay_peak` recomputes the
per-device peak of a schedule.
"""

from __future__ import annotations

import heapq

from .ledger import Ledger, describe_key, fmt_bytes
from .plan import DEVICE, HOST
from .primitives import COPIES, DESTROY, OFFLOAD, ONLOAD, Builder, Step, Unit, copy_op


class Infeasible(ValueError):
    """No schedule keeps every device under its cap; ``device`` and ``short_bytes`` say where and how much."""

    def __init__(self, message: str, device: int, short_bytes: int):
        super().__init__(message)
        self.device, self.short_bytes = device, short_bytes


def priority(s: Step) -> int:
    """Heap key: steps that release memory first, then generation -> inference -> training, then sid."""
    return (((0 if s.net <= 0 else 1) * 4 + s.stage.rank) << 32) | s.sid


_SID = (1 << 32) - 1


def duration(s: Step, bandwidth: float, latency: float) -> float:
    if s.op == DESTROY:
        return latency / 10
    return latency + max(s.acquire.values(), default=0) / bandwidth


class Scheduler:
    """Runs the simulation over a Builder's steps; may add offload steps and resource edges."""

    def __init__(self, b: Builder, ledger: Ledger, finals: dict, *, allow_offload: bool = True,
                 bandwidth: float = 10e9, latency: float = 1e-4):
        self.b, self.ledger, self.finals = b, ledger, finals
        self.allow_offload, self.bandwidth, self.latency = allow_offload, bandwidth, latency
        self.capped = bool(ledger.caps) or ledger.default_cap is not None or ledger.host_cap is not None
        self.started: set[int] = set()
        self.done: set[int] = set()
        self.waiting: dict[int, int] = {}
        self.last_release: dict[int, int] = {}
        self.offloaded: set[int] = set()

    def run(self) -> list[int]:
        steps = self.b.steps
        self.prio: dict[int, int] = {}
        self._refresh()
        self.capped = self.capped and self._caps_can_bind()
        ready = [self._priority(s) for s in steps if not self.pending[s.sid]]
        heapq.heapify(ready)
        running: list[tuple[float, int]] = []
        order: list[int] = []
        now = 0.0
        while len(self.done) < len(self.b.steps):
            ready = self._start_ready(ready, running, order, now)
            if running:
                now = self._finish_next(running, ready)
            elif ready:
                self._resolve_deadlock(ready)
                ready = [self._priority(self.b.steps[sid]) for sid in self._ready_ids()]
                heapq.heapify(ready)
            else:
                raise AssertionError("transition graph has a cycle")
        return order

    def _caps_can_bind(self) -> bool:
        """False when even every acquisition at once fits under the caps: then no step is checked and
        the simulation keeps no ledger (graph.predicted_peak replays the schedule when asked)."""
        worst = dict(self.ledger.used)
        for s in self.b.steps:
            for k, n in s.acquire.items():
                worst[k] = worst.get(k, 0) + n
        host = sum(n for k, n in worst.items() if k < 0)
        if self.ledger.host_cap is not None and host > self.ledger.host_cap:
            return True
        return any(n > self.ledger.cap(k) for k, n in worst.items() if k >= 0)

    def _priority(self, s: Step) -> int:
        p = self.prio.get(s.sid)
        if p is None:
            p = self.prio[s.sid] = priority(s)
        return p

    def _start_ready(self, ready, running, order, now):
        deferred = []
        steps, capped = self.b.steps, self.capped
        while ready:
            item = heapq.heappop(ready)
            s = steps[item & _SID]
            short = self.ledger.shortfall(s.acquire) if capped and s.acquire else None
            if short is not None:
                if s.sid not in self.waiting:  # only a release after this point can be what it waits for
                    self.last_release.pop(short[0], None)
                self.waiting[s.sid] = short[0]
                deferred.append(item)
                continue
            k = self.waiting.pop(s.sid, None)
            if k is not None and (r := self.last_release.get(k)) is not None and r not in s.deps:
                s.rdeps.add(r)
            if capped:
                self.ledger.acquire(s.acquire, check=False)
            s.start, s.end = now, now + duration(s, self.bandwidth, self.latency)
            self.started.add(s.sid)
            heapq.heappush(running, (s.end, s.sid))
            order.append(s.sid)
        for item in deferred:
            heapq.heappush(ready, item)
        return ready

    def _finish_next(self, running, ready) -> float:
        now, sid = heapq.heappop(running)
        s = self.b.steps[sid]
        if self.capped:
            self.ledger.release(s.release)
        if self.waiting:
            for k in s.release:
                self.last_release[k] = sid
        self.done.add(sid)
        pending = self.pending
        for c in self.children.get(sid, ()):
            pending[c] -= 1
            if not pending[c]:
                heapq.heappush(ready, self._priority(self.b.steps[c]))
        return now

    def _ready_ids(self) -> list[int]:
        return [s.sid for s in self.b.steps if s.sid not in self.started and not self.pending[s.sid]]

    # ------------------------------------------------------------------------------- offload fallback
    def _live_units(self) -> list[Unit]:
        live = []
        for u in self.b.units.values():
            made = u.creator is None or u.creator in self.done
            gone = u.freed_by is not None and u.freed_by in self.started
            if made and not gone:
                live.append(u)
        return live

    def _resolve_deadlock(self, ready) -> None:
        blocked = [p & _SID for p in sorted(ready)]
        first_key = self.waiting[blocked[0]]
        live = self._live_units() if self.allow_offload else []  # unchanged until an offload happens
        for sid in blocked:
            k = self.waiting[sid]
            if k < 0 or not self.allow_offload:
                continue
            step = self.b.steps[sid]
            victim = self._victim(k, step, live)
            if victim is not None:
                self._offload(victim, step)
                return
        raise self._infeasible(self.b.steps[blocked[0]], first_key)

    def _infeasible(self, step: Step, k: int) -> Infeasible:
        used, cap = self.ledger.used.get(k, 0), self.ledger.cap(k)
        short = step.acquire.get(k, 0) + used - cap
        if k < 0 and self.ledger.host_cap is not None:
            used, cap = self.ledger.host_total, self.ledger.host_cap
            short = used + sum(n for j, n in step.acquire.items() if j < 0) - cap
        units = ", ".join(self.b.units[u].label() for u in step.outputs)
        own = step.acquire.get(k, 0) + sum(self.b.units[u].nbytes for u in step.inputs
                                           if k >= 0 and self.b.units[u].memory == DEVICE
                                           and k in self.b.units[u].devices)
        if k >= 0 and own > cap:
            why = (f"the step alone needs {fmt_bytes(own)} there (its input stays until it is done), "
                   f"cap {fmt_bytes(cap)}")
        else:
            hint = "" if self.allow_offload else " (offloading to host memory was not allowed)"
            why = (f"{fmt_bytes(used)} in use, cap {fmt_bytes(cap)}; no executable destroy frees it and no unit "
                   f"there can be offloaded{hint}")
        return Infeasible(f"infeasible transition: {describe_key(k)} is short {fmt_bytes(short)} for {step.op} "
                          f"{step.stage} -> {units}: {why}. Raise the cap, or plan an intermediate step.",
                          ~k if k < 0 else k, int(short))

    def _victim(self, k: int, step: Step, live: list[Unit]) -> Unit | None:
        """A unit of ``live`` on device ``k`` that can be parked in host memory to unblock ``step``."""
        host_room = None if self.ledger.host_cap is None else self.ledger.host_cap - self.ledger.host_total
        best = None
        for u in live:
            if u.memory != DEVICE or k not in u.devices or u.uid in self.offloaded or u.onloaded:
                continue
            if u.uid in step.inputs and step.op not in COPIES:
                continue
            if u.shares_from is not None:  # a buffer it shares stays alive with its source
                src = self.b.units[u.shares_from]
                if src.freed_by is None or src.freed_by not in self.started:
                    continue
            if any(r in self.started and r not in self.done for r in u.readers):
                continue
            if host_room is not None and u.total_bytes > host_room:
                continue
            if best is None or u.nbytes > best.nbytes:
                best = u
        return best

    def _offload(self, u: Unit, blocked: Step) -> None:
        """Parks ``u`` in host memory: pending copies read the host copy, other pending readers (and
        the final plan, if ``u`` is final) get it onloaded back; whatever freed ``u`` frees its stand-in."""
        b = self.b
        self.offloaded.add(u.uid)
        pending = [b.steps[r] for r in u.readers if r not in self.started]
        for p in pending:  # a copy that would have reused u's buffers now copies everything
            for t in (b.units[uid] for uid in p.outputs):
                if t.shares_from == u.uid:
                    u.handed = {d: o for d, o in u.handed.items() if o != t.uid}
                    t.shares_from = None
        freer = b.steps[u.freed_by] if u.freed_by is not None else None
        u.freed_by = None
        h = b.unit(u.stage, u.layout, u.devices, HOST, u.spec)
        off = b.add(OFFLOAD, u.stage, inputs=(u,), outputs=(h,), frees=(u,))
        back: list[Unit] = []

        def onloaded() -> Unit:
            if not back:
                v = b.unit(u.stage, u.layout, u.devices, DEVICE, u.spec)
                v.onloaded = True
                b.add(ONLOAD, u.stage, inputs=(h,), outputs=(v,))
                back.append(v)
            return back[0]

        def stay_parked_until_unblocked() -> None:
            """The onload waits for the blocked step, unless that step (transitively) needs it."""
            if back and not any(r in self._ancestors(blocked) for r in back[0].readers):
                b.steps[back[0].creator].deps.add(blocked.sid)

        for p in pending:
            stand_in = h if p.op in COPIES else onloaded()
            self._swap(p, u, stand_in)
            if p.op in COPIES:
                p.op = copy_op(HOST, b.units[p.outputs[0]].memory)
        if freer is not None and freer.op == DESTROY:
            freer.frees, freer.deps = (h.uid,), {off.sid}
            h.freed_by = freer.sid
        final = [ms for ms, fs in self.finals.items() if any(f is u for f in fs)]
        for ms in final:
            self.finals[ms] = [onloaded() if f is u else f for f in self.finals[ms]]
        stay_parked_until_unblocked()
        extra = [x for x in (h, *back) if x.freed_by is None and not (x in back and final)]
        for x in extra:
            b.destroy(x)
        for x in (h, *back):
            if x.freed_by is not None:
                freer_x = b.steps[x.freed_by]
                freer_x.deps.update(r for r in x.readers if r != freer_x.sid)
                if x.creator is not None and x.creator != freer_x.sid:
                    freer_x.deps.add(x.creator)
        for step in {p.sid: p for p in (*pending, off, *(b.steps[x.freed_by] for x in (h, *back)
                                                         if x.freed_by is not None))}.values():
            b.account(step)
        self._refresh()

    def _ancestors(self, step: Step) -> set[int]:
        seen, todo = set(), list(step.all_deps())
        while todo:
            sid = todo.pop()
            if sid not in seen:
                seen.add(sid)
                todo.extend(self.b.steps[sid].all_deps())
        return seen

    def _swap(self, p: Step, old: Unit, new: Unit) -> None:
        """Step ``p`` reads (and, if it freed ``old``, frees) ``new`` instead of ``old``."""
        p.inputs = tuple(new.uid if x == old.uid else x for x in p.inputs)
        old.readers.remove(p.sid)
        new.readers.append(p.sid)
        if new.creator is not None:
            p.deps.add(new.creator)
        if old.uid in p.frees:
            p.frees = tuple(new.uid if x == old.uid else x for x in p.frees)
            new.freed_by = p.sid

    def _refresh(self) -> None:
        """Recounts dependencies (after offload steps were added or rewired)."""
        self.prio = {}
        self.children = children = {}
        self.pending = pending = {}
        done = self.done
        for s in self.b.steps:
            deps = s.deps | s.rdeps if s.rdeps else s.deps
            for d in deps:
                children.setdefault(d, []).append(s.sid)
            pending[s.sid] = len(deps - done) if done else len(deps)


def replay_peak(steps, initial: dict[int, int]) -> dict[int, int]:
    """Peak bytes per ledger key over a schedule: at each instant ends (releases) come before starts."""
    events = sorted([(s.start, 1, s.sid, s.acquire) for s in steps] + [(s.end, 0, s.sid, s.release) for s in steps])
    used, peak = dict(initial), dict(initial)
    for _, starting, _, table in events:
        for k, n in table.items():
            v = used.get(k, 0) + (n if starting else -n)
            used[k] = v
            if starting and v > peak.get(k, 0):
                peak[k] = v
    return peak
