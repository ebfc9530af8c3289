"""Units read slice by slice from a parameter source equal units laid out from the whole host tree."""

import jax
import numpy as np
import pytest

from nereus_jax.config import ModelConfig
from nereus_jax.elastic.emu import EMU
from nereus_jax.elastic.sources import HostSource, ValueHeadSource, ZeroSource, read_stored, units_from_source
from nereus_jax.elastic.spec import StateSpec
from nereus_jax.model_stage import ModelStage
from nereus_jax.models import abstract_params, init_params
from nereus_jax.runtime.step.losses import make_optimizer
from nereus_jax.sharding import Layout

CFG = ModelConfig(num_kv_heads=2, num_heads=8, qkv_bias=True)  # tp 4 and 8 repeat the kv heads


def _bits(x):
    x = np.asarray(x)
    return x.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[x.dtype.itemsize])


@pytest.mark.parametrize("layout", [Layout(), Layout(tp=2), Layout(tp=4), Layout(tp=2, pp=2), Layout(tp=8)])
@pytest.mark.parametrize("kind", ["train", "gen"])
def test_a_unit_read_from_a_source_equals_one_created_from_the_host_tree(devices, layout, kind):
    params = init_params(CFG, seed=3)
    opt = make_optimizer(1e-3) if kind == "train" else None
    spec = StateSpec(CFG, kind, optimizer=opt, dtype="bfloat16" if kind == "gen" else None)
    stage = ModelStage("actor", kind)
    state = {"params": jax.tree.map(lambda x: np.asarray(x, spec.dtype), params)}
    if opt is not None:
        state["opt"] = opt.init(state["params"])
    reference = EMU.create(stage, spec, layout, devices[: layout.size], state)
    (unit,) = units_from_source(stage, spec, layout, [devices[: layout.size]], HostSource(params))
    for a, b in zip(reference.leaves, unit.leaves, strict=True):
        assert a.sharding == b.sharding
        np.testing.assert_array_equal(_bits(a), _bits(b))


def test_further_replicas_copy_the_first_and_live_on_their_own_devices(devices):
    params = init_params(CFG, seed=4)
    spec = StateSpec(CFG, "infer")
    replicas = [devices[0:2], devices[2:4], devices[4:6]]
    units = units_from_source(ModelStage("ref", "infer"), spec, Layout(tp=2), replicas, HostSource(params))
    for unit, devs in zip(units, replicas, strict=True):
        assert unit.devices == tuple(devs)
        assert {d for x in unit.leaves for d in x.sharding.device_set} == set(devs)
        host = unit.to_host()["params"]
        jax.tree.map(np.testing.assert_array_equal, host, jax.tree.map(np.asarray, params))


def test_a_stored_slice_with_repeated_kv_heads_repeats_each_head_consecutively():
    spec = StateSpec(CFG, "train")
    wk = next(i for i, leaf in enumerate(spec.leaves) if leaf.kv_axis is not None)
    leaf = spec.leaves[wk]
    full = np.arange(int(np.prod(leaf.shape)), dtype=np.float32).reshape(leaf.shape)
    source = HostSource({"w": full})
    rep = 4
    stored = np.repeat(full, rep, axis=leaf.kv_axis)
    n = stored.shape[leaf.kv_axis]
    for a, b in [(0, n), (0, 3), (1, 2), (3, 7), (5, n), (2, 2)]:
        index = [slice(None)] * full.ndim
        index[leaf.kv_axis] = slice(a, b)
        got = read_stored(source, ("w",), leaf, rep, tuple(index))
        np.testing.assert_array_equal(got, stored[tuple(index)])


def test_a_critic_from_the_trunk_has_the_actors_trunk_and_a_zero_value_head(devices):
    params = init_params(CFG, seed=5)
    spec = StateSpec(CFG, "train", head="value", optimizer=make_optimizer(1e-3))
    source = ValueHeadSource(HostSource(params), CFG.hidden_size)
    (unit,) = units_from_source(ModelStage("critic", "train"), spec, Layout(tp=2), [devices[:2]], source)
    host = unit.to_host()["params"]
    assert not np.any(host["value_head"]["kernel"]) and host["value_head"]["kernel"].shape == (CFG.hidden_size, 1)
    np.testing.assert_array_equal(host["layers"]["attn"]["wq"], np.asarray(params["layers"]["attn"]["wq"]))
    assert "lm_head" not in host


def test_a_zero_source_gives_zeros_of_the_canonical_shapes(devices):
    spec = StateSpec(CFG, "infer")
    (unit,) = units_from_source(ModelStage("ref", "infer"), spec, Layout(tp=4), [devices[:4]],
                                ZeroSource(abstract_params(CFG)))
    assert all(not np.any(np.asarray(x)) for x in unit.leaves)
