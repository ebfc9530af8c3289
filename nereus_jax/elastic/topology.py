"""The job's topology: which model-stages one RL step runs, which of them own devices and state, which
run on another model-stage's units, how they are ordered in time, and (for the job) how big each call is.

One description, used alike by the planner (what to search over), the runtime (what to place, run and
price), the simulator (what to simulate) and ``python -m nereus_jax.plan``; importable without JAX. It is built
from the declared model-stages (``nereus_jax.model_stage.JOB_STAGES``: each one's phase, host if it rides,
whether a loss or task may skip it, which parameters its units start from, what it scores): declaring one
more there is enough for every layer to plan, run and simulate it (tests/runtime/test_declared_stage.py).

    topo = Topology.of_job("ppo", reward_model=False)
    topo.units        # ('actor-gen', 'ref-infer', 'actor-train', 'critic-train'): model-stages with state
    topo.host("actor-infer")   # 'actor-train': scoring with the actor runs on the training units

Two kinds of model-stage:

- a *unit* stage owns its replicas (an Elastic Model Unit each) on its own devices and keeps resident
  state there between runs: actor-gen, actor-train, critic-train, ref-infer, reward-infer;
- a *rider* runs on a unit stage's replicas with that stage's layout, parameters and devices and has no
  resident state of its own: the job scores with the actor and the critic on their training units
  (actor-infer on actor-train, critic-infer on critic-train), so scoring never needs its own copy of
  the weights. A rider still has its own call size and working set.

Time: the job runs its model-stages one after another (``concurrent`` False). Asynchronous training
overlaps actor-gen (on its own devices) with scoring and training of the previous batch: ``overlapped``.
The planner's general search (every model-stage its own units, groups of a phase side by side on
disjoint devices, as the paper plans) is ``Topology.separate``.

Call sizes: the job does not choose micro-batches per plan; they follow from its configuration
(:class:`Batching`: a token budget per training/scoring call, a cap on concurrent decodes, remat on or
off). A topology with a ``batching`` rule therefore prices and plans exactly those calls.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from nereus_jax.elastic.plan import DEVICE
from nereus_jax.model_stage import declared
from nereus_jax.rl.registry import algorithm_spec

SKIPPABLE = tuple(d.name for d in declared() if d.skippable)  # what ``skip`` may name


def accumulation_steps(rows: int, dp: int, seq_len: int, micro_batch_tokens: int) -> int:
    """Micro-batches per step so each replica's micro-batch fits the token budget; divides rows / dp."""
    if rows % dp:
        raise ValueError(f"a batch of {rows} rows does not split over dp={dp} replicas")
    per_replica = rows // dp
    fit = max(1, micro_batch_tokens // max(seq_len, 1))
    for accum in range(math.ceil(per_replica / fit), per_replica + 1):
        if per_replica % accum == 0:
            return accum
    return per_replica


@dataclass(frozen=True)
class Batching:
    """How big the job's calls are, given a stage's replica count: training and scoring cut each
    replica's rows into the fewest micro-batches of at most ``micro_batch_tokens`` tokens of ``seq_len``
    each (``accumulation_steps``); generation decodes ``min(rows per replica, max_concurrent_decodes)``
    sequences at once; training rematerialises iff ``remat``."""

    seq_len: int
    micro_batch_tokens: int
    max_concurrent_decodes: int
    remat: bool = False

    def micro_batch(self, kind: str, rows: int, dp: int) -> int | None:
        """Sequences per call of one replica (gen: decode slots); None when ``dp`` cannot split ``rows``."""
        if kind == "gen":
            return max(1, min(-(-rows // dp), self.max_concurrent_decodes))
        if rows % dp:
            return None
        return rows // dp // accumulation_steps(rows, dp, self.seq_len, self.micro_batch_tokens)


@dataclass(frozen=True)
class Topology:
    """Model-stages of one step phase by phase (run order), riders -> host, and how time composes."""

    phases: tuple[tuple[str, ...], ...]
    rides_on: tuple[tuple[str, str], ...] = ()
    concurrent: bool = True  # groups of a phase may run at once on disjoint devices
    overlapped: bool = False  # async: actor-gen runs beside scoring + training of the previous batch
    batching: Batching | None = field(default=None, compare=True)
    expert_parallel: bool = True  # a mixture of experts' scoring/training stages may split experts (ep > 1)

    # --------------------------------------------------------------------------------- builders
    @classmethod
    def separate(cls, algorithm: str, skip: Sequence[str] = ()) -> Topology:
        """The planner's general model: every model-stage its own units; a phase's groups may overlap."""
        _check_skip(skip)
        return cls(_phases(algorithm, skip))

    @classmethod
    def of_job(cls, algorithm: str, *, reward_model: bool = False, ref: bool = True, asynchronous: bool = False,
               batching: Batching | None = None, expert_parallel: bool = True) -> Topology:
        """What the job runs: actor- and critic-infer on the training units, every model-stage in turn,
        reward-infer only with a reward model, ref-infer unless the loss has no KL term (``ref``).
        ``expert_parallel``: whether its plans may split a mixture's experts (ep > 1, pp = 1, scoring and
        training: what the runtime runs); a dense model's candidates have ep = 1 either way."""
        skip = tuple(s for s, keep in (("reward-infer", reward_model), ("ref-infer", ref)) if not keep)
        phases = _phases(algorithm, skip)
        present = {s for p in phases for s in p}
        riders = tuple((d.name, d.rides_on) for d in declared() if d.rides_on and d.name in present)
        return cls(phases, riders, concurrent=False, overlapped=asynchronous, batching=batching,
                   expert_parallel=expert_parallel)

    # ---------------------------------------------------------------------------------- queries
    @property
    def stages(self) -> tuple[str, ...]:
        """Every priced model-stage, in run order (riders included)."""
        return tuple(s for p in self.phases for s in p)

    @property
    def units(self) -> tuple[str, ...]:
        """Model-stages that own devices and state (the execution plan's keys), in run order."""
        riders = dict(self.rides_on)
        return tuple(s for s in self.stages if s not in riders)

    @property
    def unit_phases(self) -> tuple[tuple[str, ...], ...]:
        """``phases`` without riders (a phase left empty is dropped): what the planner searches over."""
        riders = dict(self.rides_on)
        kept = (tuple(s for s in p if s not in riders) for p in self.phases)
        return tuple(p for p in kept if p)

    def host(self, stage: str) -> str:
        """The unit stage whose replicas run ``stage`` (itself for a unit stage)."""
        return dict(self.rides_on).get(stage, stage)

    def riders_of(self, unit: str) -> tuple[str, ...]:
        return tuple(r for r, h in self.rides_on if h == unit)

    def has_state(self, stage: str) -> bool:
        return stage not in dict(self.rides_on)

    def placed(self, plan) -> dict[str, tuple[int, ...]]:
        """Every priced model-stage -> the device ids it runs on (a rider: its host's), from a plan mapping
        unit model-stages (anything whose ``str`` is the name) to stage plans with ``devices``."""
        by_name = {str(ms): sp for ms, sp in plan.items()}
        missing = sorted({self.host(s) for s in self.stages} - set(by_name))
        if missing:
            raise KeyError(f"the plan has no model-stage {', '.join(missing)}")
        return {s: tuple(by_name[self.host(s)].devices) for s in self.stages}

    def device_bytes(self, plan, stage_bytes, shared=None) -> dict[int, float]:
        """Peak bytes per device: the resident state of every unit there + the largest working set of
        anything that runs there (they run in turn). ``stage_bytes(stage) -> (resident, working)``; a
        rider's resident state is its host's, so it counts none.

        ``shared(stage) -> (key, base) | None``: LoRA's frozen base, ``base`` bytes per device of the
        stage's resident state, and a key equal exactly for units that may hold it as one copy (share group,
        layout, dtype). Units whose keys are equal and that hold the device in the same replica (the same
        ordered device ids, ``StagePlan.replicas``), both in device memory, keep one copy there: the device
        holds the largest of their bases once instead of their sum (bases nest: a critic's trunk is inside
        the actor's base). A parked unit (``memory`` not "device") shares nothing: the runtime shares device
        arrays only. Without ``shared`` (or where it answers None) nothing changes."""
        resident: dict[int, float] = {}
        working: dict[int, float] = {}
        bases: dict[tuple, list[float]] = {}  # (device, key, replica) -> the bases of the units holding it thus
        by_name = {str(ms): sp for ms, sp in plan.items()} if shared is not None else {}
        for s, devices in self.placed(plan).items():
            r, w = stage_bytes(s)
            base = shared(s) if shared is not None and self.has_state(s) else None
            replica = self._replica_of(by_name.get(s)) if base is not None else {}
            base = base if replica else None
            for d in devices:
                resident[d] = resident.get(d, 0.0) + (r if self.has_state(s) else 0.0)
                working[d] = max(working.get(d, 0.0), w)
                if base is not None:
                    bases.setdefault((d, base[0], replica[d]), []).append(base[1])
        saved: dict[int, float] = {}
        for (d, _, _), held in bases.items():
            if len(held) > 1:
                saved[d] = saved.get(d, 0.0) + sum(held) - max(held)
        return {d: (resident[d] - saved[d] if d in saved else resident[d]) + working[d] for d in working}

    @staticmethod
    def _replica_of(sp) -> dict[int, tuple[int, ...]]:
        """Device id -> the replica of ``sp`` holding it, for a stage plan in device memory; {} for a parked
        one or a plan that names no replicas (it shares nothing)."""
        if sp is None or getattr(sp, "memory", DEVICE) != DEVICE or getattr(sp, "replicas", None) is None:
            return {}
        return {d: tuple(r) for r in sp.replicas for d in r}

    def edges(self, placed_devices, overlapped: bool | None = None) -> set[tuple[str, str]]:
        """Edges of the execution-overlap graph over ``stages``: phase-to-phase dependencies, and inside a
        phase, model-stages that share a device (or every pair, without ``concurrent``) run in order.
        ``placed_devices``: stage -> its device ids (riders: the host's). ``overlapped`` (default: the
        topology's): actor-gen has no edges, so the step is max(actor-gen, the rest)."""
        overlapped = self.overlapped if overlapped is None else overlapped
        phases = self.phases[1:] if overlapped else self.phases
        order = self.stages
        edges = {(a, b) for p, q in zip(phases, phases[1:], strict=False) for a in p for b in q}
        for phase in phases:
            ranked = sorted(phase, key=order.index)
            for i, a in enumerate(ranked):
                for b in ranked[i + 1:]:
                    if not self.concurrent or set(placed_devices[a]) & set(placed_devices[b]):
                        edges.add((a, b))
        return edges


def gen_sizes(n: int, node: int, splits: int = 8) -> list[int]:
    """Candidate device counts for actor-gen on its own devices beside the rest of a pool of ``n``:
    ``splits``-ths of the pool, at least one device each side; whole nodes of ``node`` devices once the
    pool has two (tp groups stay inside nodes on both sides)."""
    unit = node if n >= 2 * node else 1
    return sorted({min(n - unit, max(unit, unit * round(n * k / splits / unit))) for k in range(1, splits)}
                  ) if n > unit else []


def _check_skip(skip: Sequence[str]) -> None:
    skippable = [d.name for d in declared() if d.skippable]
    if any(s not in skippable for s in skip):
        raise ValueError(f"skip: only {', '.join(skippable)} can be left out, got {list(skip)}")


def uses_critic(algorithm: str) -> bool:
    """Whether ``algorithm`` trains a critic."""
    return algorithm_spec(algorithm).uses_critic


def _phases(algorithm: str, skip: Sequence[str]) -> tuple[tuple[str, ...], ...]:
    """The model-stages of one step, phase by phase (``model_stage.JOB_STAGES``); algorithms without a critic drop its
    stages."""
    critic = uses_critic(algorithm)
    kept = [d for d in declared() if d.name not in skip and (critic or not d.critic)]
    return tuple(tuple(d.name for d in kept if d.phase == p) for p in range(1 + max(d.phase for d in declared())))


def critical_path(latency: Mapping[str, float], edges: set[tuple[str, str]]) -> float:
    """Longest path through an execution-overlap graph (model-stages weighted by their latency)."""
    preds: dict[str, list[str]] = {s: [] for s in latency}
    for a, b in edges:
        if a in preds and b in preds:
            preds[b].append(a)
    finish: dict[str, float] = {}

    def end(s: str) -> float:
        if s not in finish:
            finish[s] = latency[s] + max((end(p) for p in preds[s]), default=0.0)
        return finish[s]

    return max(end(s) for s in latency)
