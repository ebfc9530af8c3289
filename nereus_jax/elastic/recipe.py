"""Per model-stage, old layout -> new layout as Split -> Destroy -> Extend -> Merge (the paper's recipe).

Through the largest layout both the old and the new layout split into (``common_layout``):

* A new replica on exactly an old replica's device list is one Relayout (Split and Merge fused into one
  jitted reshard: it holds old + new bytes per device, never the common layout's bigger pieces).
* A new replica whose devices are covered by sub-replicas of old replicas is made *in place*: Split the
  old replicas (on their own devices), then Merge the pieces (on the new replica's devices). No Extend.
* Otherwise the first new replica is built from copies: Extend sub-replicas of one old replica onto its
  devices, then Merge; every further new replica is an Extend of a finished one in the new layout
  (same index map: a per-shard copy, each shard sent once, sources taken round-robin as they appear).
* With the same layout on both sides, replicas on the same devices are kept, the rest are Extends.
* Old replicas and pieces nobody reads are destroyed at once; sources after their readers.
* Relayouts need device memory: parked (pinned_host) sources are onloaded first, parked targets are
  offloaded last. With the same layout a copy moves between memory kinds directly.

``derive=True`` is the weight sync: the sources belong to another model-stage (actor-train), are read
and never freed, and every relayout starts with a Derive (cast to the target's dtypes, drop the optimizer).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from nereus_jax.layout import Layout
from nereus_jax.model_stage import ModelStage

from .factor import STRIDED, common_layout, mode_options, sub_replicas
from .plan import DEVICE, HOST, ExecutionPlan, StagePlan
from .primitives import DERIVE, GATHER, MERGE, OFFLOAD, ONLOAD, RELAYOUT, SCATTER, SPLIT, Builder, Unit, for_dp

IDENTITY = None  # "no split": the unit itself is its only piece


def compile_stage(b: Builder, ms: ModelStage, old: Sequence[Unit], new: StagePlan, spec: Any, *,
                  derive: bool = False, stale: Sequence[Unit] = ()) -> list[Unit]:
    """Adds the steps that turn ``old`` units into ``new``'s replicas; returns the final units. ``spec``: the
    stage's state with the whole optimizer on every replica; where it splits the optimizer over the replicas
    (``for_dp``), the old units hold blocks of it and so will the new ones."""
    if not derive and (for_dp(spec, len(old)) is not spec or for_dp(spec, new.dp) is not spec):
        return _regrouped(b, ms, old, new, spec)
    return _compile_whole(b, ms, old, new, spec, derive=derive, stale=stale)


def _regrouped(b: Builder, ms: ModelStage, old: Sequence[Unit], new: StagePlan, spec: Any) -> list[Unit]:
    """A model-stage whose optimizer state is split over its replicas before or after: the blocks are gathered
    into whole state on the old replicas (Gather), that moves as any state does, and the new replicas split it
    into their blocks (Scatter). A change of memory kind alone moves each replica's block as it is."""
    if old[0].layout == new.layout and tuple(u.devices for u in old) == new.replicas:
        finals = _same_layout(b, ms, old, new, old[0].spec)
        b.finish_stage(list(old), finals)
        return finals
    units, made = list(old), []
    if for_dp(spec, len(old)) is not spec:
        units = [_onload(b, u, made) for u in units]
        whole = [b.unit(ms, u.layout, u.devices, DEVICE, spec) for u in units]
        b.add(GATHER, ms, inputs=units, outputs=whole, frees=units)
        units = whole
    finals = _compile_whole(b, ms, units, dataclasses.replace(new, memory=DEVICE), spec)
    split = for_dp(spec, new.dp)
    if split is not spec:
        blocks = [b.unit(ms, new.layout, u.devices, DEVICE, split) for u in finals]
        b.add(SCATTER, ms, inputs=finals, outputs=blocks, frees=finals)
        finals = blocks
    if new.memory != DEVICE:
        parked = [b.unit(ms, u.layout, u.devices, new.memory, u.spec) for u in finals]
        for u, h in zip(finals, parked, strict=True):
            b.add(OFFLOAD, ms, inputs=(u,), outputs=(h,), frees=(u,))
        finals = parked
    b.finish_stage(made, finals)
    return finals


def _onload(b: Builder, u: Unit, made: list[Unit]) -> Unit:
    if u.memory == DEVICE:
        return u
    v = b.unit(u.stage, u.layout, u.devices, DEVICE, u.spec)
    made.append(v)
    b.add(ONLOAD, u.stage, inputs=(u,), outputs=(v,), frees=(u,))
    return v


def _compile_whole(b: Builder, ms: ModelStage, old: Sequence[Unit], new: StagePlan, spec: Any, *,
                   derive: bool = False, stale: Sequence[Unit] = ()) -> list[Unit]:
    lo, ln = old[0].layout, new.layout
    for u in stale:
        b.destroy(u)
    if lo == ln and not derive:
        finals = _same_layout(b, ms, old, new, spec)
        b.finish_stage(list(old), finals)
        return finals
    stage = _Relayout(b, ms, old, new, spec, derive)
    finals = stage.run()
    b.finish_stage(stage.units, finals)
    return finals


def _same_layout(b: Builder, ms: ModelStage, old: Sequence[Unit], new: StagePlan, spec: Any) -> list[Unit]:
    by_devices = {u.devices: u for u in old}
    finals: list[Unit | None] = [None] * new.dp
    kept: set[int] = set()
    for i, n in enumerate(new.replicas):
        u = by_devices.get(n)
        if u is None:
            continue
        kept.add(u.uid)
        if u.memory == new.memory:
            finals[i] = u
        else:  # park or unpark in place
            t = b.unit(ms, new.layout, n, new.memory, spec)
            b.add(OFFLOAD if new.memory == HOST else ONLOAD, ms, inputs=(u,), outputs=(t,), frees=(u,))
            finals[i] = t
    position = {(d, j): u for u in old if u.uid not in kept for j, d in enumerate(u.devices)}
    pool = [u for u in old if u.freed_by is None] + [u for u in finals if u is not None and u.freed_by is None]
    pool = list({u.uid: u for u in pool}.values())
    turn = 0
    for i, n in enumerate(new.replicas):
        if finals[i] is not None:
            continue
        src = _best_positional(position, n)
        if src is None:
            src, turn = pool[turn % len(pool)], turn + 1
        t = b.unit(ms, new.layout, n, new.memory, spec)
        b.copy(src, t, share=src.uid not in kept)
        finals[i] = t
        pool.append(t)
    return finals  # type: ignore[return-value]


def _best_positional(position: dict, devices: tuple[int, ...]) -> Unit | None:
    """The unit holding the most of ``devices`` at the same positions (its shards are reused)."""
    counts: dict[int, tuple[int, Unit]] = {}
    for j, d in enumerate(devices):
        u = position.get((d, j))
        if u is not None:
            counts[u.uid] = (counts.get(u.uid, (0, u))[0] + 1, u)
    return max(counts.values(), key=lambda cu: cu[0])[1] if counts else None


class _Relayout:
    """One model-stage whose layout changes (or a weight sync): chooses pieces, then emits steps."""

    def __init__(self, b: Builder, ms: ModelStage, old: Sequence[Unit], new: StagePlan, spec: Any, derive: bool):
        self.b, self.ms, self.old, self.new, self.spec, self.derive = b, ms, list(old), new, spec, derive
        self.lo, self.ln = self.old[0].layout, new.layout
        self.lc = common_layout(self.lo, self.ln)
        self.units: list[Unit] = [] if derive else list(old)  # units this stage owns (destroyed if unused)
        opts = mode_options(self.lo, self.lc) if derive or self.lo != self.lc else [IDENTITY]
        self.o_opts = [opts] * len(self.old)
        self.r_mode: dict[int, Any] = {}
        self.pieces: dict[int, list[Unit]] = {}  # old index -> its pieces in the common layout
        self.by_tuple: dict[tuple[int, ...], Unit] = {}
        self.fused: set[int] = set()  # old indices consumed by a fused Relayout
        self._piece_cache: dict[tuple[int, Any], list[tuple[int, ...]]] = {}
        self.t_opts = [IDENTITY] if self.ln == self.lc else mode_options(self.ln, self.lc)

    def _pieces_of(self, r: int, modes) -> list[tuple[int, ...]]:
        cached = self._piece_cache.get((r, modes))
        if cached is None:
            u = self.old[r]
            cached = [u.devices] if modes is IDENTITY else sub_replicas(u.devices, self.lo, self.lc, modes)
            self._piece_cache[(r, modes)] = cached
        return cached

    def _target_tuples(self, n: tuple[int, ...], modes) -> list[tuple[int, ...]]:
        return [n] if modes is IDENTITY else sub_replicas(n, self.ln, self.lc, modes)

    def run(self) -> list[Unit]:
        finals: list[Unit | None] = [None] * self.new.dp
        self._fused(finals)
        in_place = self._choose_in_place(skip={i for i, u in enumerate(finals) if u is not None})
        for i, (modes, picks) in in_place.items():
            parts = [self._piece(r, t) for t, r in picks]
            finals[i] = self._merge(self.new.replicas[i], parts, modes)
        rest = [i for i in range(self.new.dp) if finals[i] is None]
        if rest and len(rest) == self.new.dp:
            i = rest.pop(0)
            finals[i] = self._first_by_copies(self.new.replicas[i])
        sources = [u for u in finals if u is not None]
        for turn, i in enumerate(rest):
            t = self.b.unit(self.ms, self.ln, self.new.replicas[i], DEVICE, self.spec)
            self.units.append(t)
            self.b.copy(sources[turn % len(sources)], t, share=False)
            finals[i] = t
            sources.append(t)
        return [self._park(u) for u in finals]  # type: ignore[arg-type]

    def _fused(self, finals: list[Unit | None]) -> None:
        """New replicas on exactly an old replica's device list: one Relayout (or Derive) each."""
        by_devices = {u.devices: r for r, u in enumerate(self.old)}
        for i, n in enumerate(self.new.replicas):
            r = by_devices.get(n)
            if r is None:
                continue
            src = self._on_device(self.old[r])
            t = self.b.unit(self.ms, self.ln, n, DEVICE, self.spec)
            self.units.append(t)
            op, frees = (DERIVE, ()) if self.derive else (RELAYOUT, (src,))
            self.b.add(op, self.ms, inputs=(src,), outputs=(t,), frees=frees)
            self.fused.add(r)
            finals[i] = t

    def _choose_in_place(self, skip: set[int]) -> dict[int, tuple[Any, list]]:
        """New replica index -> (its modes, [(piece tuple, old index)]) for replicas covered by pieces."""
        owner = {d: r for r, u in enumerate(self.old) if r not in self.fused for d in u.devices}
        index: dict[tuple[int, ...], list[tuple[int, Any]]] = {}
        indexed: set[int] = set()
        out: dict[int, tuple[Any, list]] = {}
        used: set[tuple[int, ...]] = set()
        r_mode, get_owner = self.r_mode, owner.get
        for i, n in enumerate(self.new.replicas):
            olds = {get_owner(d) for d in n}
            if i in skip or None in olds:
                continue
            for r in olds:
                if r not in indexed:
                    indexed.add(r)
                    for modes in self.o_opts[r]:
                        for t in self._pieces_of(r, modes):
                            index.setdefault(t, []).append((r, modes))
            for modes in self.t_opts:
                tentative, picks = {}, []
                for t in self._target_tuples(n, modes):
                    pick = None
                    if t not in used:
                        for r, m in index.get(t, ()):
                            if tentative.get(r, r_mode.get(r, m)) == m:
                                pick = (r, m)
                                break
                    if pick is None:
                        break
                    tentative[pick[0]] = pick[1]
                    picks.append((t, pick[0]))
                else:
                    self.r_mode.update(tentative)
                    used.update(t for t, _ in picks)
                    out[i] = (modes, picks)
                    break
        return out

    def _split(self, r: int) -> list[Unit]:
        if r in self.pieces:
            return self.pieces[r]
        u = self._on_device(self.old[r])
        modes = self.r_mode.setdefault(r, self.o_opts[r][0])
        if modes is IDENTITY:
            parts = [u]
        else:
            parts = [self.b.unit(self.ms, self.lc, t, DEVICE, self.spec) for t in self._pieces_of(r, modes)]
            self.units.extend(parts)
            op, frees = (DERIVE, ()) if self.derive else (SPLIT, (u,))
            self.b.add(op, self.ms, inputs=(u,), outputs=parts, frees=frees, modes=modes)
        self.pieces[r] = parts
        for p in parts:
            self.by_tuple[p.devices] = p
        return parts

    def _piece(self, r: int, t: tuple[int, ...]) -> Unit:
        self._split(r)
        return self.by_tuple[t]

    def _on_device(self, u: Unit) -> Unit:
        if u.memory == DEVICE:
            return u
        v = self.b.unit(u.stage, u.layout, u.devices, DEVICE, u.spec)
        self.units.append(v)
        self.b.add(ONLOAD, u.stage, inputs=(u,), outputs=(v,), frees=() if self.derive else (u,))
        return v

    def _merge(self, n: tuple[int, ...], parts: list[Unit], modes) -> Unit:
        if modes is IDENTITY:
            return parts[0]
        t = self.b.unit(self.ms, self.ln, n, DEVICE, self.spec)
        self.units.append(t)
        self.b.add(MERGE, self.ms, inputs=parts, outputs=(t,), frees=parts, modes=modes)
        return t

    def _first_by_copies(self, n: tuple[int, ...]) -> Unit:
        """The first new replica when none can be made in place: copies of pieces, then Merge."""
        modes = self.t_opts[0]
        targets = self._target_tuples(n, modes)
        if self.lo == self.lc and not self.derive:
            sources = list(self.old)
        else:
            near = max((r for r in range(len(self.old)) if r not in self.fused),
                       key=lambda r: (len(set(self.old[r].devices) & set(n)), self.old[r].memory == DEVICE))
            sources = self._split(near)
        direct = {p.devices: p for p in sources if p.devices in set(targets)}
        position = {(d, j): p for p in sources for j, d in enumerate(p.devices)}
        owned = {u.uid for u in self.units} - {p.uid for p in direct.values()}
        parts = []
        for turn, t in enumerate(targets):
            if t in direct:
                parts.append(self._on_device(direct[t]))
                continue
            src = _best_positional(position, t) or sources[turn % len(sources)]
            p = self.b.unit(self.ms, self.lc, t, DEVICE, self.spec)
            self.units.append(p)
            self.b.copy(src, p, share=src.uid in owned)
            parts.append(p)
        return self._merge(n, parts, modes)

    def _park(self, u: Unit) -> Unit:
        if self.new.memory == DEVICE:
            return u
        h = self.b.unit(u.stage, u.layout, u.devices, HOST, u.spec)
        self.units.append(h)
        self.b.add(OFFLOAD, u.stage, inputs=(u,), outputs=(h,), frees=(u,))
        return h


def align_ranks(old: ExecutionPlan, new: ExecutionPlan) -> ExecutionPlan:
    """``new`` with the devices inside each replica reordered (never moved between replicas) so that a
    replica assembled from old replicas of a smaller layout gets them *strided*: every device then
    already holds a superset of its new shard and the Merge is a local slice (no exchange). Device
    sets, layouts and dp are unchanged; a controller may apply this to any plan it picked, since the
    planner chooses device sets and degrees, not the rank order within a replica."""
    out = {}
    for ms, sp in new.items():
        prev = old.get(ms)
        replicas = sp.replicas
        if prev is not None and prev.memory == sp.memory == DEVICE:
            lc = common_layout(prev.layout, sp.layout)
            if prev.layout == lc != sp.layout:
                owner = {d: r for r in prev.replicas for d in r}
                replicas = tuple(_interleave(n, prev.layout, sp.layout, owner) for n in sp.replicas)
        out[ms] = StagePlan(sp.layout, replicas, sp.memory)
    return ExecutionPlan(out)


def _interleave(n: tuple[int, ...], small: Layout, big: Layout, owner: dict) -> tuple[int, ...]:
    """``n`` reordered so that the old replicas covering it are its strided sub-replicas (else ``n``)."""
    pieces = list(dict.fromkeys(owner.get(d) for d in n))
    if None in pieces or sum(len(p) for p in pieces) != len(n):
        return n
    positions = sub_replicas(tuple(range(len(n))), big, small, (STRIDED, STRIDED))
    order = [0] * len(n)
    for piece, pos in zip(pieces, positions, strict=True):
        for device, i in zip(piece, pos, strict=True):
            order[i] = device
    return tuple(order)
