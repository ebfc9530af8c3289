"""What a model-stage is: one model role (actor, critic, ref, reward) in one kind of stage (gen, infer, train).

The one identity of a model-stage, without JAX: :class:`ModelStage` (``role``, ``kind``) and its name,
``"actor-gen"``, which is its form at the edges (config keys under ``plan.stages``, checkpoint plan JSON,
command-line output) and the key the cost model, planner and simulator use (``str(ms)``,
``ModelStage.parse(name)``, :func:`split_stage`). The stage constants live here too.

    ms = ModelStage("actor", "gen")
    str(ms)                               # "actor-gen"
    ModelStage.parse("actor-gen") == ms   # True; ms.role == "actor", ms.kind == "gen"
"""

from __future__ import annotations

import dataclasses

STAGE_KINDS = ("gen", "infer", "train")  # also the transition tie-break order: generation first
# Model roles whose network ends in a value head (scalar per token) instead of the lm head.
VALUE_HEAD_MODELS = ("critic", "reward")


class StageError(ValueError):
    """An unknown model-stage name or kind, or an impossible per-stage choice."""


@dataclasses.dataclass(frozen=True, order=True)
class ModelStage:
    """One model ``role`` in one stage ``kind``, e.g. ``ModelStage("actor", "gen")``; ``str()`` gives
    ``actor-gen``. The kind (gen, infer or train) also picks the sharding rules."""

    role: str
    kind: str

    def __post_init__(self) -> None:
        if not isinstance(self.role, str) or not self.role:
            raise StageError(f"model-stage role must be a non-empty string, got {self.role!r}")
        if self.kind not in STAGE_KINDS:
            raise StageError(f"model-stage {self.role}-{self.kind}: stage must be one of {STAGE_KINDS}")

    @classmethod
    def parse(cls, name: str) -> ModelStage:
        """``"actor-gen"`` -> ``ModelStage("actor", "gen")``."""
        role, sep, kind = name.rpartition("-")
        if not sep or not role:
            raise StageError(f"model-stage name {name!r}: expected ROLE-KIND, like actor-gen")
        return cls(role, kind)

    @property
    def rank(self) -> int:
        """Tie-break rank in a transition: generation, then inference, then training."""
        return STAGE_KINDS.index(self.kind)

    def __str__(self) -> str:
        return f"{self.role}-{self.kind}"


@dataclasses.dataclass(frozen=True)
class StageDecl:
    """One model-stage a job can run, declared once (:data:`JOB_STAGES`). :mod:`nereus_jax.elastic.topology`
    builds a step from these (phases, riders, what may be skipped) for the planner, the cost model, the
    simulator and the runtime; the runtime reads ``state`` (which parameters a unit starts from) and ``scores``
    (what a scoring stage computes); the config accepts their names under ``plan.stages``. (Declared here,
    at the bottom of the import graph, because the config below ``elastic`` checks those names.)"""

    name: str                          # ROLE-KIND, e.g. "ref-infer"
    phase: int                         # 0 generation, 1 scoring, 2 training (the step's phases, in order)
    rides_on: str | None = None        # a rider: runs on this unit stage's replicas, layout and parameters
    critic: bool = False               # only with an algorithm that trains a critic
    skippable: bool = False            # may be left out of a step (``Topology.of_job``'s ``skip``)
    state: str | None = None           # a unit's starting parameters: "actor", "base" (the actor without LoRA
                                       # adapters), "critic" or "reward-model"
    scores: tuple[str, str] | None = None  # a scoring stage the learner runs: (its program, its output's key)


# The model-stages of an RL step, in run order within each phase. ref-infer is skipped by a KL-free loss,
# reward-infer by a verifiable reward; actor- and critic-infer score on the training units.
JOB_STAGES: list[StageDecl] = [
    StageDecl("actor-gen", 0, state="actor"),
    StageDecl("actor-infer", 1, rides_on="actor-train", scores=("logprobs", "old_logp")),
    StageDecl("ref-infer", 1, skippable=True, state="base", scores=("logprobs", "ref_logp")),
    StageDecl("reward-infer", 1, skippable=True, state="reward-model"),
    StageDecl("critic-infer", 1, rides_on="critic-train", critic=True, scores=("values", "values")),
    StageDecl("actor-train", 2, state="actor"),
    StageDecl("critic-train", 2, critic=True, state="critic"),
]


def declared() -> tuple[StageDecl, ...]:
    """Every declared model-stage (:data:`JOB_STAGES`, read when called: a test may declare one more)."""
    return tuple(JOB_STAGES)


def stage_decl(name: str) -> StageDecl:
    """The declaration of model-stage ``name`` (StageError naming the declared ones)."""
    for d in JOB_STAGES:
        if d.name == name:
            return d
    raise StageError(f"no model-stage {name!r} is declared; declared: {', '.join(stage_names())}")


def stage_names() -> tuple[str, ...]:
    """Every declared model-stage name, sorted (the keys ``plan.stages`` accepts)."""
    return tuple(sorted(d.name for d in JOB_STAGES))


def job_roles() -> tuple[str, ...]:
    """Every model role some declared model-stage runs (actor, critic, ref, reward), sorted."""
    return tuple(sorted({d.name.rpartition("-")[0] for d in JOB_STAGES}))


ACTOR_GEN = ModelStage("actor", "gen")
ACTOR_TRAIN = ModelStage("actor", "train")
REF_INFER = ModelStage("ref", "infer")
CRITIC_TRAIN = ModelStage("critic", "train")
REWARD_INFER = ModelStage("reward", "infer")

def split_stage(name: str) -> tuple[str, str]:
    """'actor-gen' -> ('actor', 'gen'), for a declared model-stage (:data:`JOB_STAGES`); another name is an
    error listing the declared ones."""
    if not any(d.name == name for d in JOB_STAGES):
        raise StageError(f"unknown model-stage '{name}'; valid: {', '.join(stage_names())}")
    role, _, kind = name.rpartition("-")
    return role, kind


def stage_kind(name: str) -> str:
    """gen, infer or train."""
    return split_stage(name)[1]


def stage_head(name: str) -> str:
    """'lm' for actor/ref, 'value' for critic/reward."""
    return "value" if split_stage(name)[0] in VALUE_HEAD_MODELS else "lm"
