"""Execution plans (validated, hashable, printable)."""

import pytest
from elastic_helpers import ACTOR_GEN, ACTOR_TRAIN, REF

from nereus_jax.elastic.plan import HOST, ExecutionPlan, PlanError, StagePlan
from nereus_jax.model_stage import ModelStage, StageError, split_stage, stage_names
from nereus_jax.sharding import Layout


def test_model_stage_names_round_trip_and_rank_generation_first():
    assert ModelStage.parse("actor-gen") == ACTOR_GEN and str(ACTOR_TRAIN) == "actor-train"
    assert ModelStage.parse("reward-model-infer") == ModelStage("reward-model", "infer")
    assert (ACTOR_GEN.role, ACTOR_GEN.kind) == ("actor", "gen")
    assert ACTOR_GEN.rank < REF.rank < ACTOR_TRAIN.rank
    assert all(split_stage(n) == (ModelStage.parse(n).role, ModelStage.parse(n).kind) for n in stage_names())
    with pytest.raises(StageError, match="stage must be one of"):
        ModelStage("actor", "serve")
    with pytest.raises(StageError, match="expected ROLE-KIND"):
        ModelStage.parse("actor")


def test_stage_plan_rejects_wrong_replica_sizes_and_reused_devices():
    with pytest.raises(PlanError, match=r"replica \[0, 1, 2\] has 3 devices; tp2xpp1 needs 2"):
        StagePlan(Layout(2), ((0, 1, 2),))
    with pytest.raises(PlanError, match=r"devices \[1\] appear in more than one replica"):
        StagePlan(Layout(2), ((0, 1), (1, 2)))
    assert StagePlan.contiguous(Layout(2, 2), 2, first=4).replicas == ((4, 5, 6, 7), (8, 9, 10, 11))


def test_execution_plan_is_hashable_compares_by_value_and_prints_a_table():
    c = StagePlan.contiguous
    a = ExecutionPlan({ACTOR_TRAIN: c(Layout(2), 2), "actor-gen": c(Layout(1), 4)})
    b = ExecutionPlan({ACTOR_GEN: c(Layout(1), 4), ACTOR_TRAIN: c(Layout(2), 2)})
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a.replace(REF, StagePlan.contiguous(Layout(1), 1, memory=HOST)) != a
    rows = str(a).splitlines()
    assert rows[0].split() == ["model-stage", "layout", "dp", "memory", "replicas"]
    assert rows[1].split()[:4] == ["actor-gen", "tp1xpp1", "4", "device"]
    assert rows[2].endswith("[0,1] [2,3]")
    assert a.devices == (0, 1, 2, 3)
