"""Sharded forward against the single-device reference; layout/gather round trips bit for bit."""

import dataclasses

import jax
import numpy as np
import pytest

from nereus_jax.config import ModelConfig
from nereus_jax.models import forward, init_params
from nereus_jax.sharding import (
    Layout,
    LayoutError,
    activation_sharding,
    bytes_per_device,
    check_layout,
    gather_params,
    kv_repeat,
    make_mesh,
    param_shardings,
    shard_params,
)

TINY = ModelConfig()  # 4 heads, 2 kv heads: tp=4 exercises kv-head replication


@pytest.fixture(scope="module")
def params():
    return init_params(TINY, seed=0)


@pytest.fixture(scope="module")
def batch():
    tokens = jax.random.randint(jax.random.key(1), (8, 12), 0, TINY.vocab_size)
    mask = np.ones((8, 12), np.int32)
    mask[1, 9:] = 0
    mask[5, 4:] = 0
    return tokens, mask


@pytest.fixture(scope="module")
def reference(params, batch):
    with jax.default_device(jax.devices()[0]):
        return np.asarray(jax.jit(forward, static_argnums=1)(params, TINY, batch[0], None, batch[1]))


def _sharded_logits(params, batch, layout, dp, devices, kind="infer"):
    mesh = make_mesh(devices[: layout.size * dp], layout, dp=dp)
    sharded = shard_params(params, TINY, layout, mesh, kind=kind)
    data = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("dp"))
    tokens, mask = jax.device_put(batch, data)
    with activation_sharding(mesh, kind):
        fn = jax.jit(forward, static_argnums=1)
        return fn(sharded, TINY, tokens, None, mask)


@pytest.mark.smoke
@pytest.mark.parametrize("tp,dp", [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2), (4, 2), (1, 8), (2, 4)])
def test_sharded_forward_matches_single_device(params, batch, reference, devices, tp, dp):
    logits = _sharded_logits(params, batch, Layout(tp=tp), dp, devices)
    assert len(logits.sharding.device_set) == tp * dp
    np.testing.assert_allclose(np.asarray(logits), reference, atol=1e-5, rtol=0)


def test_sharded_value_head_matches_single_device(batch, devices):
    params = init_params(TINY, seed=3, head="value")
    ref = np.asarray(forward(params, TINY, batch[0], None, batch[1]))
    mesh = make_mesh(devices[:4], Layout(tp=2), dp=2)
    sharded = shard_params(params, TINY, Layout(tp=2), mesh, kind="infer")
    values = jax.jit(forward, static_argnums=1)(sharded, TINY, batch[0], None, batch[1])
    np.testing.assert_allclose(np.asarray(values), ref, atol=1e-5)


@pytest.mark.parametrize("layout,dp", [(Layout(1, 1), 1), (Layout(2, 1), 2), (Layout(4, 1), 1), (Layout(2, 2), 2),
                                        (Layout(1, 2), 4), (Layout(4, 2), 1)])
@pytest.mark.smoke
def test_lay_out_then_gather_is_bit_exact(params, devices, layout, dp):
    mesh = make_mesh(devices[: layout.size * dp], layout, dp=dp)
    back = gather_params(shard_params(params, TINY, layout, mesh), TINY)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), params, back)


def test_layers_axis_is_split_over_pp(params, devices):
    mesh = make_mesh(devices[:4], Layout(tp=2, pp=2))
    sharded = shard_params(params, TINY, Layout(tp=2, pp=2), mesh)
    wq = sharded["layers"]["attn"]["wq"]
    assert wq.sharding.shard_shape(wq.shape) == (1, TINY.hidden_size, TINY.num_heads // 2, TINY.head_dim)


def test_tp_above_kv_heads_stores_one_kv_head_per_rank_and_counts_the_copies(params, devices):
    layout = Layout(tp=4)
    assert kv_repeat(TINY, layout) == 2
    sharded = shard_params(params, TINY, layout, make_mesh(devices[:4], layout))
    wk = sharded["layers"]["attn"]["wk"]
    assert wk.shape[2] == 4 and wk.sharding.shard_shape(wk.shape)[2] == 1
    canonical = params["layers"]["attn"]["wk"]
    per_device = bytes_per_device({"wk": wk})
    # Each of the 4 ranks holds one kv head: 4 heads' worth in all, twice the model's 2 kv heads.
    assert set(per_device.values()) == {canonical.nbytes // 2}
    assert sum(per_device.values()) == 2 * canonical.nbytes


@pytest.mark.parametrize("layout,needle", [
    (Layout(tp=3), "heads"),
    (Layout(tp=8), "heads"),
    (Layout(pp=3), "layers"),
])
def test_layout_that_cannot_divide_is_rejected_with_the_dimension_named(layout, needle):
    with pytest.raises(LayoutError, match=needle):
        check_layout(TINY, layout)


def test_tp_not_a_multiple_of_kv_heads_is_rejected():
    cfg = dataclasses.replace(TINY, num_heads=6, num_kv_heads=2, head_dim=16, hidden_size=96)
    with pytest.raises(LayoutError, match="num_kv_heads"):
        check_layout(cfg, Layout(tp=3))


def test_vocab_not_divisible_by_tp_is_rejected():
    cfg = dataclasses.replace(TINY, vocab_size=130)
    with pytest.raises(LayoutError, match="vocab"):
        param_shardings(cfg, Layout(tp=4), make_mesh(jax.devices()[:4], Layout(tp=4)))


def test_make_mesh_rejects_wrong_device_count(devices):
    with pytest.raises(LayoutError, match="needs 4 devices, got 3"):
        make_mesh(devices[:3], Layout(tp=2, pp=2))
