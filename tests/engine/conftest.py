"""Shared fixtures of the engine tests: the tiny model's parameters and one tp=1 engine, compiled once."""

import pytest
from _engine_testlib import TINY, make_engine

from nereus_jax.engine import Generator
from nereus_jax.models import init_params


@pytest.fixture(scope="session")
def raw_params():
    return init_params(TINY, seed=0)


@pytest.fixture(scope="session")
def engine(devices):
    return make_engine(devices)


@pytest.fixture(scope="session")
def params(engine, raw_params):
    return engine.load_params(raw_params)


@pytest.fixture()
def gen(engine, params):
    return Generator(engine, params)
