"""Every legal way to run one model-stage, priced by the cost model: the planner's per-stage options.

A candidate is (tp, pp, dp, micro-batch, remat, ep) with its step latency, devices and bytes per device.
Legal: tp divides the node size (TP stays inside a node) and the model's heads, mlp and vocab (kv
heads: a divisor or a multiple, as ``sharding.kv_repeat`` allows); pp divides the layers, and is 1
for generation (the engine's rule); dp divides the stage's sequences (train: a mini-batch's) so every
replica gets the same batch, and the micro-batch divides a replica's sequences (calls per update =
gradient accumulation; the global batch never changes); dp x tp x pp fits the pool with whole tp groups
inside nodes. A mixture of experts' scoring and training stages also take every ep that divides its experts
(ep x tp x pp x dp fitting the pool; with pp = 1, as the runtime runs them); generation and dense models keep
ep = 1. Degrees need not be powers of two. Candidates that cannot
fit even alone (resident + working > usable) are dropped.

Pricing is the cost model's pure functions, reorganised for speed: a call's cost does not depend on dp
(except on shared compute) and is computed once per (layout, micro-batch, remat); the per-step terms
once per (layout, dp); model-stages with the same network and kind share call prices.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

import numpy as np

from nereus_jax.config import ModelConfig
from nereus_jax.elastic.costs import counts
from nereus_jax.elastic.costs.latency import (
    MEM,
    accumulation_seconds,
    call_latency,
    call_sizes,
    gen_latency,
    step_terms_latency,
)
from nereus_jax.elastic.costs.memory import (
    accumulation_bytes,
    call_working_bytes,
    optimizer_shards,
    resident_bytes,
    working_bytes,
)
from nereus_jax.elastic.costs.model import CostModel
from nereus_jax.elastic.costs.stage import StageChoice
from nereus_jax.model_stage import split_stage, stage_head


@functools.lru_cache(maxsize=256)
def kind_head(stage: str) -> tuple[str, str]:
    """(kind, head): model-stages that agree on both price a call the same."""
    return split_stage(stage)[1], stage_head(stage)


@functools.lru_cache(maxsize=4096)
def _divisors(n: int) -> tuple[int, ...]:
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return tuple(sorted(set(small + [n // d for d in small])))


def divisors(n: int) -> list[int]:
    """Positive divisors of n, ascending."""
    return list(_divisors(n))


Row = tuple[float, int, float, float, tuple[int, int, int, int, bool, int]]  # latency, devices, resident, working,
# choice (tp, pp, dp, micro_batch, remat, ep)
Block = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]  # the same, as arrays (choices: n x 6)
RAW = 6  # columns of a choice row: tp, pp, dp, micro_batch, remat, ep
UNIT = (0, 1, 2, 5)  # the columns that say which units run it: tp, pp, dp, ep


@dataclass(frozen=True)
class RiderCalls:
    """A rider's call at each of its host's options (parallel to the host's arrays): it runs on the host's
    replicas, so its tp, pp and dp are the host's; its micro-batch, seconds and working set are its own."""

    stage: str
    table: np.ndarray  # n x 6 ints, as StageOptions.table
    latency: np.ndarray
    working: np.ndarray

    @property
    def raw(self) -> np.ndarray:
        """n x 5: tp, pp, dp, micro_batch, remat (``table`` without ep)."""
        return self.table[:, :5]

    def choice(self, i: int) -> StageChoice:
        return _choice(self.table[i])


@dataclass(frozen=True)
class StageOptions:
    """A model-stage's candidates as parallel arrays, sorted by (devices, latency). A host's options carry
    its riders' calls (``riders``): ``latency`` then includes them and ``working`` is the largest of all."""

    stage: str
    latency: np.ndarray  # seconds per step
    devices: np.ndarray  # int
    resident: np.ndarray  # bytes per device kept between runs
    working: np.ndarray  # extra bytes per device while running
    table: np.ndarray  # n x 6 ints: tp, pp, dp, micro_batch, remat, ep
    riders: tuple[RiderCalls, ...] = ()

    def __len__(self) -> int:
        return len(self.latency)

    @property
    def raw(self) -> np.ndarray:
        """n x 5: tp, pp, dp, micro_batch, remat (``table`` without ep, which is 1 unless experts split)."""
        return self.table[:, :5]

    def choice(self, i: int) -> StageChoice:
        return _choice(self.table[i])

    def own_latency(self, i: int) -> float:
        """Seconds of the model-stage's own calls (its riders' excluded)."""
        return float(self.latency[i]) - sum(float(r.latency[i]) for r in self.riders)

    def masked(self, keep: np.ndarray) -> StageOptions:
        """The options where ``keep`` is True (riders kept in step)."""
        riders = tuple(RiderCalls(r.stage, r.table[keep], r.latency[keep], r.working[keep]) for r in self.riders)
        return StageOptions(self.stage, self.latency[keep], self.devices[keep], self.resident[keep],
                            self.working[keep], self.table[keep], riders)

    def ranked_by(self, latency: np.ndarray) -> StageOptions:
        """The same options with ``latency`` (one value per option) in place of their seconds, re-sorted by
        (devices, latency) as the search expects; riders kept in step, their own seconds unchanged."""
        order = np.lexsort((self.working, latency, self.devices))
        return replace(self.masked(order), latency=np.asarray(latency)[order])

    @classmethod
    def build(cls, stage: str, rows: Iterable[Row]) -> StageOptions:
        rows = list(rows)
        return cls.from_blocks(stage, [_block(rows)] if rows else [])

    @classmethod
    def from_blocks(cls, stage: str, blocks: list[Block]) -> StageOptions:
        if not blocks:
            return cls(stage, np.zeros(0), np.zeros(0, dtype=np.int64), np.zeros(0), np.zeros(0),
                       np.zeros((0, RAW), dtype=np.int64))
        lat, dev, res, work, raw = (np.concatenate(parts) for parts in zip(*blocks, strict=True))
        order = np.lexsort((work, lat, dev))
        return cls(stage, lat[order], dev[order].astype(np.int64), res[order], work[order], raw[order])



def _choice(raw) -> StageChoice:
    tp, pp, dp, mb, remat, ep = (int(v) for v in raw)
    return StageChoice(tp, pp, dp, mb, bool(remat), ep)


def _unit(row) -> tuple[int, ...]:
    """(tp, pp, dp, ep) of a choice row: the units it runs on."""
    return tuple(int(row[i]) for i in UNIT)


def fold_riders(host: StageOptions, riders: list[StageOptions], usable: float, exact: bool) -> StageOptions:
    """The host's options with its riders' calls at the same (tp, pp, dp, ep) added: latency summed, working
    set the largest (they run in turn on the same devices), resident state the host's alone. A host option
    is repeated for every rider call worth having there (the fastest that adds no working set, and each
    faster one that adds some, while it fits beside the host's resident state), so the search trades a
    rider's speed against memory like any other choice. ``exact``: a rider has one call per layout (the
    job's batching). Host options a rider cannot run at are dropped."""
    out = host
    for r in riders:
        if exact and len({_unit(row) for row in r.table}) != len(r):
            raise ValueError(f"{r.stage}: more than one call per layout under a batching rule")
        out = _fold_one(out, r, usable)
    return out.masked(np.lexsort((out.working, out.latency, out.devices)))


def _fold_one(host: StageOptions, rider: StageOptions, usable: float) -> StageOptions:
    frontiers = _frontiers(rider)
    rows, calls = [], []
    for i, row in enumerate(host.table):
        front = frontiers.get(_unit(row))
        if front is None:
            continue
        room = usable - host.resident[i]
        work = rider.working[front]
        free = np.nonzero(work <= host.working[i])[0]  # calls that add no working set: the last is fastest
        start = free[-1] if len(free) else 0
        for j in front[start:][work[start:] <= room]:
            rows.append(i)
            calls.append(j)
    i, j = np.array(rows, dtype=np.int64), np.array(calls, dtype=np.int64)
    riders = tuple(RiderCalls(c.stage, c.table[i], c.latency[i], c.working[i]) for c in host.riders)
    riders += (RiderCalls(rider.stage, rider.table[j], rider.latency[j], rider.working[j]),)
    return StageOptions(host.stage, host.latency[i] + rider.latency[j], host.devices[i], host.resident[i],
                        np.maximum(host.working[i], rider.working[j]), host.table[i], riders)


def _frontiers(rider: StageOptions) -> dict[tuple[int, ...], np.ndarray]:
    """Per (tp, pp, dp, ep): the rider's calls by working set ascending whose latency improves on every call
    with a smaller working set (the memory/speed Pareto frontier)."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for j, row in enumerate(rider.table):
        groups.setdefault(_unit(row), []).append(j)
    out = {}
    for key, idx in groups.items():
        idx = np.array(idx, dtype=np.int64)
        idx = idx[np.lexsort((rider.latency[idx], rider.working[idx]))]
        lat = rider.latency[idx]
        best_before = np.minimum.accumulate(np.concatenate(([np.inf], lat)))[:-1]
        out[key] = idx[lat < best_before]
    return out


def _block(rows: list[Row]) -> Block:
    """Rows as arrays; a choice of 5 (tp, pp, dp, micro_batch, remat) has ep 1."""
    lat, dev, res, work, raw = zip(*rows, strict=True)
    table = np.array([tuple(c) + (1,) * (RAW - len(c)) for c in raw], dtype=np.int64).reshape(-1, RAW)
    return (np.array(lat, dtype=float), np.array(dev, dtype=np.int64), np.array(res, dtype=float),
            np.array(work, dtype=float), table)


def expert_degrees(cfg: ModelConfig, stage: str, expert_parallel: bool = True) -> list[int]:
    """The ep degrees a model-stage may take: the divisors of a mixture's experts for scoring and training,
    else 1 (dense models; generation, whose engine runs the experts unsplit; ``expert_parallel`` off)."""
    split = expert_parallel and cfg.num_experts and split_stage(stage)[1] != "gen"
    return divisors(cfg.num_experts) if split else [1]


def shapes(cfg: ModelConfig, stage: str, devices_per_node: int, tp_capacity: Callable[[int], int],
           expert_parallel: bool = True) -> list[tuple[int, int, int]]:
    """(tp, pp, ep) layouts the model, the stage kind and the pool allow."""
    gen = split_stage(stage)[1] == "gen"
    out = []
    for tp in divisors(devices_per_node):
        for pp in [1] if gen else divisors(cfg.num_layers):
            for ep in expert_degrees(cfg, stage, expert_parallel):
                if counts.layout_problem(cfg, tp, pp, ep) is None and tp * pp * ep <= tp_capacity(tp):
                    out.append((tp, pp, ep))
    return out


def price(cfg: ModelConfig, stage: str, choice: StageChoice, workload, cost_model: CostModel) -> Row:
    """(latency, devices, resident, working, choice) of one choice, straight from the cost model."""
    hw = cost_model.hardware
    lat = cost_model.stage_latency(cfg, stage, choice, workload).total
    raw = (choice.tp, choice.pp, choice.dp, choice.micro_batch, choice.remat, choice.ep)
    shards = optimizer_shards(stage, choice.dp, workload)
    return (lat, choice.devices, resident_bytes(cfg, stage, choice.tp, choice.pp, shards, choice.ep),
            working_bytes(cfg, stage, choice, workload, hw), raw)


class Pricer:
    """Prices candidates, sharing call prices between model-stages with the same network and kind."""

    def __init__(self, cost_model: CostModel, workload):
        self.cost_model = cost_model
        self.workload = workload
        self.eff = cost_model.efficiency_vector
        self._calls: dict[tuple, np.ndarray] = {}  # keys use id(config): the configs outlive the pricer
        self._grids: dict[tuple, tuple] = {}

    def options(self, cfg: ModelConfig, stage: str, tp_capacity: Callable[[int], int], usable: float,
                rider: bool = False, expert_parallel: bool = True) -> StageOptions:
        """Every legal candidate of ``stage`` that fits ``usable`` bytes per device on its own (a ``rider``
        keeps no resident state: it runs on its host's); ep > 1 only with ``expert_parallel``."""
        hw = self.cost_model.hardware
        train = split_stage(stage)[1] == "train"
        blocks = []
        for tp, pp, ep in shapes(cfg, stage, hw.devices_per_node, tp_capacity, expert_parallel):
            # the least any dp holds (a split optimizer shrinks as dp grows)
            most = max((dp for dp in divisors(self.workload.rows_for(split_stage(stage)[1]))
                        if tp * pp * ep * dp <= tp_capacity(tp)), default=1)
            shards = optimizer_shards(stage, most, self.workload)
            resident = 0.0 if rider else resident_bytes(cfg, stage, tp, pp, shards, ep)
            least = resident + hw.workspace_bytes  # every call also holds its gradients
            if least + (accumulation_bytes(cfg, stage, tp, pp, ep) if train else 0.0) > usable:
                continue
            block = self._shape_block(cfg, stage, tp, pp, ep, tp_capacity(tp))
            if block is not None:
                if rider:
                    block = (block[0], block[1], np.zeros_like(block[2]), block[3], block[4])
                keep = block[2] + block[3] <= usable
                blocks.append(tuple(a[keep] for a in block))
        return StageOptions.from_blocks(stage, blocks)

    def rule_options(self, cfg: ModelConfig, stage: str, tp_capacity: Callable[[int], int], usable: float,
                     batching, rider: bool = False, expert_parallel: bool = True) -> StageOptions:
        """The candidates of ``stage`` whose calls are the ones the job makes (``batching``: a
        ``topology.Batching``): one call size per (tp, pp, ep, dp), priced one by one."""
        hw, wl = self.cost_model.hardware, self.workload
        kind = split_stage(stage)[1]
        total = wl.rows_for(kind)
        rows = []
        for tp, pp, ep in shapes(cfg, stage, hw.devices_per_node, tp_capacity, expert_parallel):
            for dp in divisors(total):
                mb = batching.micro_batch(kind, total, dp)
                if tp * pp * ep * dp > tp_capacity(tp) or mb is None:
                    continue
                choice = StageChoice(tp, pp, dp, mb, batching.remat and kind == "train", ep)
                lat, devices, resident, working, raw = price(cfg, stage, choice, wl, self.cost_model)
                resident = 0.0 if rider else resident
                if resident + working <= usable:
                    rows.append((lat, devices, resident, working, raw))
        return StageOptions.build(stage, rows)

    def _shape_block(self, cfg: ModelConfig, stage: str, tp: int, pp: int, ep: int, limit: int) -> Block | None:
        wl = self.workload
        kind = split_stage(stage)[1]
        total = wl.rows_for(kind)
        dps = [dp for dp in divisors(total) if tp * pp * ep * dp <= limit]
        if not dps:
            return None
        if kind == "gen":
            return self._gen_block(cfg, stage, tp, total, dps)
        return self._grid(cfg, stage, kind, tp, pp, ep, total, dps)

    def _gen_block(self, cfg, stage, tp, total, dps) -> Block:
        """Every (dp, decode slots) of a tp degree, each dp's slot counts priced at once."""
        wl, hw = self.workload, self.cost_model.hardware
        res = resident_bytes(cfg, stage, tp, 1)
        rows = []
        for dp in dps:
            slots = divisors(total // dp)
            n = np.array(slots, dtype=float)
            eff = self.cost_model.efficiency_at(*call_sizes(cfg, "gen", tp, 1, dp, n, wl))
            lat = gen_latency(cfg, stage, tp, dp, n, wl, hw, eff).total
            for i, n in enumerate(slots):
                choice = StageChoice(tp, 1, dp, n)
                rows.append((float(lat[i]), tp * dp, res, working_bytes(cfg, stage, choice, wl, hw),
                             (tp, 1, dp, n, 0, 1)))
        return _block(rows)

    def _grid(self, cfg, stage, kind, tp, pp, ep, total, dps) -> Block:
        """Every (dp, micro-batch, remat) of a layout at once: calls and working sets are priced per
        (micro-batch, remat), per-step terms per dp, and combined with array arithmetic. The call part is
        shared by model-stages with the same network and kind (actor-/ref-infer, critic-/reward-infer)."""
        wl, hw, eff = self.workload, self.cost_model.hardware, self.eff
        key = (id(cfg), kind_head(stage), tp, pp, ep, tuple(dps))
        if key not in self._grids:
            self._grids[key] = self._call_grid(cfg, stage, kind, tp, pp, ep, total, dps)
        lat, d, calls, work, raw = self._grids[key]
        dp_arr = np.array(dps)
        one = np.broadcast_to(step_terms_latency(cfg, stage, tp, pp, dp_arr, 1, wl, hw, eff, ep).total, dp_arr.shape)
        if kind == "train":
            extra = np.broadcast_to(accumulation_seconds(cfg, stage, tp, pp, dp_arr, hw, ep) / eff[MEM], dp_arr.shape)
            lat = lat + extra[d] * (calls - 1)
        lat = lat + one[d]
        if kind == "train":  # calls are per update; each of the step's updates repeats them and the step terms
            lat = lat * wl.updates
        resident = np.array([resident_bytes(cfg, stage, tp, pp, optimizer_shards(stage, dp, wl), ep) for dp in dps])
        return (lat, tp * pp * ep * np.array(dps)[d], resident[d], work, raw)

    def _call_grid(self, cfg, stage, kind, tp, pp, ep, total, dps):
        """(calls x call seconds, dp index, calls, working bytes, choices) of every valid row."""
        wl, hw = self.workload, self.cost_model.hardware
        mbs = divisors(total)
        remats = (False, True) if kind == "train" else (False,)
        dp_arr = np.array(dps)
        calls = (total // dp_arr)[:, None] / np.array(mbs)[None, :]  # [dp, mb]; fractional = not a divisor
        valid = np.equal(np.mod(calls, 1), 0)
        if hw.shared_compute:  # a call's rate depends on how many devices share the host
            call = np.array([[self._calls_of(cfg, stage, tp, pp, ep, mbs, r, int(tp * pp * ep * dp)) for r in remats]
                             for dp in dps]).transpose(0, 2, 1)  # [dp, mb, remat]
        else:
            call = np.array([self._calls_of(cfg, stage, tp, pp, ep, mbs, r, 0) for r in remats]).T[None]
        single = np.array([call_working_bytes(cfg, stage, tp, pp, np.array(mbs), r, wl, hw, False, ep)
                           for r in remats]).T  # [mb, remat]
        summed = accumulation_bytes(cfg, stage, tp, pp, ep) if kind == "train" else 0.0
        work = np.stack([single, single + summed], axis=-1)  # [mb, remat, accumulating]
        d, m, r = np.nonzero(np.broadcast_to(valid[:, :, None], (len(dps), len(mbs), len(remats))))
        c = calls[d, m]
        lat = c * call[d if hw.shared_compute else 0, m, r]
        raw = np.stack([np.full(len(d), tp), np.full(len(d), pp), dp_arr[d], np.array(mbs)[m], r, np.full(len(d), ep)],
                       axis=1)
        return lat, d, c, work[m, r, (c > 1).astype(np.int64)], raw

    def _calls_of(self, cfg, stage, tp, pp, ep, mbs: list[int], remat, devices) -> np.ndarray:
        """Seconds of one call for every size in ``mbs``; ``devices`` only matters on shared compute."""
        key = (id(cfg), kind_head(stage), tp, pp, ep, remat, devices)
        call = self._calls.get(key)
        if call is None:
            sizes = np.array(mbs)
            eff = self.cost_model.efficiency_at(*call_sizes(cfg, split_stage(stage)[1], tp, pp, 1, sizes,
                                                            self.workload))
            call = self._calls[key] = call_latency(cfg, stage, tp, pp, sizes, remat, self.workload,
                                                   self.cost_model.hardware, eff, max(devices, tp * pp * ep), ep).total
        return call
