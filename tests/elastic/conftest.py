"""Shared fixtures: the tiny model's specs and canonical states, and a factory that lays out EMUs."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from elastic_helpers import ACTOR_GEN, ACTOR_TRAIN, CRITIC, REF, TINY

from nereus_jax.elastic.emu import EMU
from nereus_jax.elastic.spec import StateSpec
from nereus_jax.models import init_params


def _train_state(seed: int, tx) -> dict:
    params = init_params(TINY, seed)
    # Non-trivial optimizer state, so a mixed-up leaf cannot pass by being zero.
    opt = jax.tree.map(lambda x: x + 7 if x.ndim == 0 else x + 0.5, tx.init(params))
    return jax.tree.map(np.asarray, {"params": params, "opt": opt})


@pytest.fixture(scope="session")
def tx():
    return optax.adam(1e-3)


@pytest.fixture(scope="session")
def specs(tx):
    return {
        ACTOR_TRAIN: StateSpec(TINY, "train", optimizer=tx),
        CRITIC: StateSpec(TINY, "train", optimizer=tx),
        ACTOR_GEN: StateSpec(TINY, "gen", dtype="bfloat16"),
        REF: StateSpec(TINY, "infer"),
    }


@pytest.fixture(scope="session")
def states(tx):
    actor = _train_state(0, tx)
    return {
        ACTOR_TRAIN: actor,
        CRITIC: _train_state(1, tx),
        ACTOR_GEN: {"params": jax.tree.map(lambda x: np.asarray(jnp.asarray(x, jnp.bfloat16)), actor["params"])},
        REF: {"params": jax.tree.map(np.asarray, init_params(TINY, 2))},
    }


@pytest.fixture(scope="session")
def make_units(devices, specs, states):
    """plan -> {model-stage: [EMU per replica]} laid out from the canonical states."""

    def make(plan):
        return {ms: [EMU.create(ms, specs[ms], sp.layout, [devices[i] for i in r], states[ms], sp.memory)
                     for r in sp.replicas]
                for ms, sp in plan.items()}

    return make
