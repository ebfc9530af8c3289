"""The search: the separable relaxation and its dynamic program (frontiers, groups, pool splits), the
memory-coupled knapsack bound, the first feasible plans (knapsack caps, resident-byte prices) and the
branch and bound over per-model-stage resident ranges. See ``nereus_jax.elastic.planner``."""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from nereus_jax.elastic.costs.candidates import StageOptions
from nereus_jax.elastic.planner.problem import Problem

GAP = 0.02  # stop once the best plan is proven within 2% of the optimum
MAX_NODES = 400  # branch-and-bound nodes before returning the best plan found (its gap says how good)
KNAPSACK_BUCKETS = 256
WORK_RESERVES = (0.03, 0.08, 0.15, 0.25, 0.4, 0.6)  # working-set room tried by first_plans
PRICE_LADDER = tuple(2.0**k for k in range(-6, 9))  # resident-byte prices (x step latency / usable bytes)
REL_TOL = 1e-9  # relative slack in latency and byte comparisons (float rounding is not a difference)


@dataclass(frozen=True)
class PhaseSolution:
    """One phase: its groups (model-stage names in run order) and each member's option index."""

    latency: float
    stages: tuple[tuple[str, ...], ...]
    picks: tuple[tuple[int, ...], ...]


def _frontier(opt: StageOptions, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(devices, latency, option index) of the best option for at most n devices, at each n where it
    improves (options are sorted by devices, then latency)."""
    idx = np.nonzero(mask)[0]
    lat = opt.latency[idx]
    best_before = np.minimum.accumulate(np.concatenate(([np.inf], lat)))[:-1]
    keep = lat < best_before * (1 - REL_TOL)
    return opt.devices[idx[keep]], lat[keep], idx[keep]


def _group_curve(fronts: Sequence[tuple], limit: int):
    """(devices used, latency, member option indices [members x points]) of a group running its members
    one after another, at every useful pool size <= limit; latencies strictly descending."""
    sizes = np.unique(np.concatenate([f[0] for f in fronts]))
    sizes = sizes[sizes <= limit]
    pos = [np.searchsorted(f[0], sizes, side="right") - 1 for f in fronts]
    ok = np.all([p >= 0 for p in pos], axis=0)
    if not ok.any():
        return None
    pos = [p[ok] for p in pos]
    lat = np.sum([f[1][p] for f, p in zip(fronts, pos, strict=True)], axis=0)
    used = np.max([f[0][p] for f, p in zip(fronts, pos, strict=True)], axis=0)
    best_before = np.minimum.accumulate(np.concatenate(([np.inf], lat)))[:-1]
    keep = lat < best_before * (1 - REL_TOL)
    picks = np.array([f[2][p[keep]] for f, p in zip(fronts, pos, strict=True)])
    return used[keep], lat[keep], picks


def set_partitions(items: Sequence[str]) -> Iterator[list[tuple[str, ...]]]:
    """Every way to split ``items`` into groups (order inside a group kept)."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in set_partitions(rest):
        yield [(first,), *part]
        for i in range(len(part)):
            yield [*part[:i], (first, *part[i]), *part[i + 1:]]


def _split_pool(part, curves, pool: int) -> PhaseSolution:
    """The smallest phase latency tau such that every group reaches tau within the pool together."""
    if len(curves) == 1:
        used, lat, picks = curves[0]
        return PhaseSolution(float(lat[-1]), (part[0],), (tuple(int(i) for i in picks[:, -1]),))
    taus = np.unique(np.concatenate([c[1] for c in curves]))
    total = np.zeros(len(taus))
    chosen = []
    for used, lat, _ in curves:  # first point at or below tau (lat descending); past the end: impossible
        i = np.searchsorted(-lat, -taus * (1 + REL_TOL), side="left")
        chosen.append(i)
        total += np.where(i < len(lat), used[np.minimum(i, len(lat) - 1)], pool + 1)
    feasible = np.nonzero(total <= pool)[0]
    if not len(feasible):
        return None
    k = feasible[0]
    idx = [int(i[k]) for i in chosen]
    latency = max(float(c[1][i]) for c, i in zip(curves, idx, strict=True))
    picks = tuple(tuple(int(j) for j in c[2][:, i]) for c, i in zip(curves, idx, strict=True))
    return PhaseSolution(latency, tuple(part), picks)


def _solve_phase(phase: Sequence[str], fronts: Mapping[str, tuple], pool: int, concurrent: bool,
                 alternatives: list[PhaseSolution] | None = None) -> PhaseSolution | None:
    """The fastest split of the pool between the groups of this phase, over every partition into groups."""
    best = None
    partitions = sorted(set_partitions(list(phase)), key=len) if concurrent else [[tuple(phase)]]
    cache: dict[tuple[str, ...], tuple | None] = {}
    for part in partitions:
        for g in part:
            if g not in cache:
                cache[g] = _group_curve([fronts[s] for s in g], pool)
        curves = [cache[g] for g in part]
        if any(c is None for c in curves):
            continue
        # No group beats its time on the whole pool, and the groups' device-seconds share the pool.
        floor = max(max(float(c[1][-1]) for c in curves), sum(float(np.min(c[0] * c[1])) for c in curves) / pool)
        if best is not None and alternatives is None and floor >= best.latency * (1 - REL_TOL):
            continue
        sol = _split_pool(part, curves, pool)
        if sol is None:
            continue
        if alternatives is not None:
            alternatives.append(sol)
        if best is None or sol.latency < best.latency * (1 - REL_TOL):
            best = sol
    return best


def solve_relaxation(problem: Problem, opts: Mapping[str, StageOptions], masks: Mapping[str, np.ndarray],
                     alternatives: list[list[PhaseSolution]] | None = None) -> list[PhaseSolution] | None:
    """The best plan using only the masked options, ignoring memory coupling; None if a phase can't run."""
    fronts = {s: _frontier(opts[s], masks[s]) for s in problem.stages}
    out = []
    for phase in problem.phases:
        alt = [] if alternatives is not None else None
        sol = _solve_phase(phase, fronts, len(problem.pool), problem.concurrent, alt)
        if sol is None:
            return None
        if alternatives is not None:
            alternatives.append(alt)
        out.append(sol)
    return out


def picked(sols: Sequence[PhaseSolution]) -> dict[str, int]:
    """Model-stage -> option index of a solution."""
    return {s: i for sol in sols for names, group in zip(sol.stages, sol.picks, strict=True)
            for s, i in zip(names, group, strict=True)}


def memory_need(opts: Mapping[str, StageOptions], picks: Mapping[str, int]) -> float:
    """sum(resident) + max(working) of a plan: the planner's memory rule."""
    return (sum(float(opts[s].resident[i]) for s, i in picks.items())
            + max(float(opts[s].working[i]) for s, i in picks.items()))


# ------------------------------------------------------------------------------------------ memory coupling
def restrict(problem: Problem, opts, lo, hi, caps=None):
    """Masks of the options inside the node's resident ranges that fit beside the smallest resident state
    the other model-stages can still have (to a fixed point); with ``caps``, beside the others' caps
    instead (every combination then fits). None if some model-stage has no option left."""
    usable = problem.usable_bytes * (1 + REL_TOL)
    masks = {s: (o.resident >= lo[s]) & (o.resident <= hi[s]) for s, o in opts.items()}
    while True:
        if not all(m.any() for m in masks.values()):
            return None, None
        least = {s: float(opts[s].resident[masks[s]].min()) for s in opts}
        others = caps or least
        total = sum(others.values())
        new = {s: masks[s] & (opts[s].resident + opts[s].working + total - others[s] <= usable) for s in opts}
        if all(new[s].sum() == masks[s].sum() for s in opts):
            return masks, least
        masks = new


def _knapsack(problem: Problem, opts, masks, value_of, reserve: float, round_up: bool):
    """Minimise the sum of ``value_of(stage, options mask) -> values`` over one resident size per
    model-stage with sum(resident) <= usable - ``reserve`` (room left for working sets). Rounding resident
    sizes down to buckets gives a relaxation; rounding up, resident caps that surely fit.
    Returns (value, resident cap per model-stage) or (inf, None)."""
    budget = problem.usable_bytes - reserve
    if budget <= 0:
        return math.inf, None
    step = budget / KNAPSACK_BUCKETS
    best = np.full(KNAPSACK_BUCKETS + 1, np.inf)
    best[0] = 0.0
    trail = []
    for s in problem.stages:
        o, m = opts[s], masks[s]
        levels, inverse = np.unique(o.resident[m], return_inverse=True)
        value = np.full(len(levels), np.inf)
        np.minimum.at(value, inverse, value_of(s, m))
        buckets = (np.ceil(levels / step * (1 - REL_TOL)) if round_up else np.floor(levels / step)).astype(np.int64)
        source = np.arange(len(best))[None, :] - buckets[:, None]  # [level, total bucket]
        cand = np.where(source >= 0, best[np.maximum(source, 0)], np.inf) + value[:, None]
        arg = np.argmin(cand, axis=0)
        nxt = cand[arg, np.arange(len(best))]
        trail.append((s, levels, buckets, arg))
        best = nxt
    k = int(np.argmin(best))
    if not np.isfinite(best[k]):
        return math.inf, None
    total, caps = float(best[k]), {}
    for s, levels, buckets, arg in reversed(trail):
        j = int(arg[k])
        caps[s] = float(levels[j])
        k -= int(buckets[j])
    return total, caps


def _lower_bound(problem: Problem, opts, masks) -> float:
    """A step-latency lower bound that keeps the memory coupling: a phase lasts at least its device-seconds
    over the pool (a lone model-stage: its latency), and the plan needs at least the largest unavoidable
    working set beside the resident states."""
    pool = len(problem.pool)
    alone = {s for phase in problem.phases if len(phase) == 1 for s in phase}

    def value(s, m):
        o = opts[s]
        return o.latency[m] if s in alone else o.latency[m] * o.devices[m] / pool

    reserve = max(float(opts[s].working[masks[s]].min()) for s in opts)
    return _knapsack(problem, opts, masks, value, reserve, round_up=False)[0]


def _capped_plan(problem: Problem, opts, caps: Mapping[str, float]):
    """The best plan whose model-stages keep their resident state under ``caps``: an option is allowed if
    it fits beside every other model-stage at its cap, so whatever the relaxation picks fits."""
    usable = problem.usable_bytes * (1 + REL_TOL)
    total = sum(caps.values())
    masks = {s: (o.resident <= caps[s]) & (o.resident + o.working + total - caps[s] <= usable)
             for s, o in opts.items()}
    if not all(m.any() for m in masks.values()):
        return None
    return solve_relaxation(problem, opts, masks)


def first_plans(problem: Problem, opts, root_masks) -> list[list[PhaseSolution]]:
    """Feasible plans from knapsack resident caps, one per working-set reserve on a grid: each caps
    resident sizes to minimise the sum of model-stage latencies (colocated) within the rest."""
    out, tried = [], set()
    for fraction in WORK_RESERVES:
        reserve = fraction * problem.usable_bytes

        def value(s, m, reserve=reserve):
            o = opts[s]
            return np.where(o.working[m] <= reserve, o.latency[m], np.inf)

        _, caps = _knapsack(problem, opts, root_masks, value, reserve, round_up=True)
        if caps is not None and tuple(caps.values()) not in tried:
            tried.add(tuple(caps.values()))
            sols = _capped_plan(problem, opts, caps)
            if sols is not None:
                out.append(sols)
    return out


def _penalised(opts, price_per_byte: float):
    """Options whose latency carries a price on resident bytes (a Lagrangian view of the memory rule)."""
    return {s: dataclasses.replace(o, latency=o.latency + price_per_byte * o.resident) for s, o in opts.items()}


def lagrangian_plans(problem: Problem, opts, masks) -> list[list[PhaseSolution]]:
    """Feasible plans from pricing resident bytes: the smallest price on a ladder whose plan fits (binary
    search). Unlike the knapsack caps, this keeps concurrent groups in view."""
    sols0 = solve_relaxation(problem, opts, masks)
    if sols0 is None:
        return []
    scale = sum(p.latency for p in sols0) / problem.usable_bytes
    usable = problem.usable_bytes * (1 + REL_TOL)
    lo, hi, out = 0, len(PRICE_LADDER) - 1, []
    while lo <= hi:
        mid = (lo + hi) // 2
        sols = solve_relaxation(problem, _penalised(opts, PRICE_LADDER[mid] * scale), masks)
        picks = picked(sols) if sols is not None else None
        if picks is not None and memory_need(opts, picks) <= usable:
            out.append(_true_latency(problem, opts, sols))
            hi = mid - 1
        else:
            lo = mid + 1
    return out


def _true_latency(problem: Problem, opts, sols: Sequence[PhaseSolution]) -> list[PhaseSolution]:
    """The same picks with phase latencies recomputed from the unpenalised options."""
    out = []
    for sol in sols:
        groups = [sum(float(opts[s].latency[i]) for s, i in zip(names, picks, strict=True))
                  for names, picks in zip(sol.stages, sol.picks, strict=True)]
        out.append(dataclasses.replace(sol, latency=max(groups)))
    return out


@dataclass(order=True)
class _Node:
    bound: float
    seq: int
    lo: dict = field(compare=False)
    hi: dict = field(compare=False)
    sols: list = field(compare=False)
    least: dict = field(compare=False)


def branch_and_bound(problem: Problem, opts: Mapping[str, StageOptions], gap: float = GAP,
                     max_nodes: int = MAX_NODES):
    """(feasible solutions met, fastest first; proven bound on the best one's relative suboptimality)."""
    usable = problem.usable_bytes * (1 + REL_TOL)
    counter = itertools.count()
    heap: list[_Node] = []
    found: list[tuple[float, list[PhaseSolution]]] = []
    floor = [math.inf]  # the smallest bound of a node set aside as within the gap

    def incumbent() -> float:
        return min((f[0] for f in found), default=math.inf)

    def push(lo, hi, root=False):
        masks, least = restrict(problem, opts, lo, hi)
        if masks is None:
            return None
        sols = solve_relaxation(problem, opts, masks)
        if sols is None:
            return None
        relaxed = sum(p.latency for p in sols)
        if root and memory_need(opts, picked(sols)) <= usable:
            found.append((relaxed, sols))
            return masks
        bound = max(relaxed, _lower_bound(problem, opts, masks))
        if bound < incumbent() * (1 - gap):
            heapq.heappush(heap, _Node(bound, next(counter), lo, hi, sols, least))
        else:
            floor[0] = min(floor[0], bound)
        return masks

    root = push({s: 0.0 for s in opts}, {s: math.inf for s in opts}, root=True)
    if root is not None and not found:
        found.extend((sum(p.latency for p in sols), sols) for sols in first_plans(problem, opts, root))
        if not heap or heap[0].bound < incumbent() * (1 - gap):  # not yet within the gap: price memory too
            found.extend((sum(p.latency for p in sols), sols) for sols in lagrangian_plans(problem, opts, root))
        floor[0] = min([floor[0]] + [n.bound for n in heap if n.bound >= incumbent() * (1 - gap)])
        heap = [n for n in heap if n.bound < incumbent() * (1 - gap)]
    nodes = 0
    while heap and nodes < max_nodes:
        node = heapq.heappop(heap)
        if node.bound >= incumbent() * (1 - gap):
            heap = [node]
            break
        nodes += 1
        picks = picked(node.sols)
        if memory_need(opts, picks) <= usable:
            found.append((node.bound, node.sols))
            continue
        slack = {s: float(opts[s].resident[i]) - node.least[s] for s, i in picks.items()}
        stage = max(problem.stages, key=lambda s: (slack[s], -problem.stages.index(s)))
        r = float(opts[stage].resident[picks[stage]])
        below = opts[stage].resident[(opts[stage].resident >= node.lo[stage]) & (opts[stage].resident < r)]
        if len(below):
            push(node.lo, {**node.hi, stage: float(below.max())})
        push({**node.lo, stage: r}, node.hi)
    found.sort(key=lambda f: f[0])
    best = found[0][0] if found else math.inf
    bound = min([best, floor[0]] + [n.bound for n in heap])
    return found, max(0.0, (best - bound) / best) if found else math.inf
