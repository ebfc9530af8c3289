"""Model-stages, the tiny model, and checks shared by the elastic tests: every check compares a unit's
gathered canonical state with the host state it was made from, bit for bit."""

import numpy as np

from nereus_jax.config import ModelConfig
from nereus_jax.elastic import ModelStage

TINY = ModelConfig()  # 4 heads, 2 kv heads: tp=4 stores each kv head twice
ACTOR_TRAIN = ModelStage("actor", "train")
ACTOR_GEN = ModelStage("actor", "gen")
REF = ModelStage("ref", "infer")
CRITIC = ModelStage("critic", "train")


def assert_state(units, spec, state):
    """Every unit holds ``state`` bit for bit (params and optimizer state)."""
    want = spec.flatten(state)
    for unit in units:
        got = spec.flatten(unit.to_host())
        assert len(got) == len(want)
        for a, b in zip(want, got, strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape
            np.testing.assert_array_equal(a, b)


def assert_plan_units(out, plan, specs, states):
    """``out`` holds exactly ``plan``'s replicas, each bit-exact."""
    assert set(out) == set(plan)
    for ms, sp in plan.items():
        assert [u.device_ids for u in out[ms]] == list(sp.replicas)
        assert all(u.layout == sp.layout and u.memory == sp.memory for u in out[ms])
        assert_state(out[ms], specs[ms], states[ms])
