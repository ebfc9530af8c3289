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
# The model-stages a job can have (the keys of ``plan.stages`` in a config).
STAGE_NAMES = (
    "actor-gen",
    "actor-infer",
    "actor-train",
    "critic-infer",
    "critic-train",
    "ref-infer",
    "reward-infer",
)
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
        """``"actor-gen"`` -> ``ModelStage("actor", "gen")`` (the names of :data:`STAGE_NAMES`)."""
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


ACTOR_GEN = ModelStage("actor", "gen")
ACTOR_TRAIN = ModelStage("actor", "train")
REF_INFER = ModelStage("ref", "infer")
CRITIC_TRAIN = ModelStage("critic", "train")
REWARD_INFER = ModelStage("reward", "infer")

_SPLIT = {name: tuple(name.split("-")) for name in STAGE_NAMES}


def split_stage(name: str) -> tuple[str, str]:
    """'actor-gen' -> ('actor', 'gen'), for the names of :data:`STAGE_NAMES`; unknown names list the valid ones."""
    try:
        return _SPLIT[name]
    except KeyError:
        raise StageError(f"unknown model-stage '{name}'; valid: {', '.join(STAGE_NAMES)}") from None


def stage_kind(name: str) -> str:
    """gen, infer or train."""
    return split_stage(name)[1]


def stage_head(name: str) -> str:
    """'lm' for actor/ref, 'value' for critic/reward."""
    return "value" if split_stage(name)[0] in VALUE_HEAD_MODELS else "lm"
