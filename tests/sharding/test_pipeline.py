"""Pipeline parallelism (GPipe and 1F1B over pp, tp inside stages) against the pp=1 model on one device."""

import dataclasses
import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from nereus_jax.config import AlgorithmConfig, ModelConfig
from nereus_jax.models import forward, init_params
from nereus_jax.runtime.step import losses
from nereus_jax.sharding import Layout, LayoutError, activation_sharding, gather_params, make_mesh, shard_params
from nereus_jax.sharding.pipeline import (
    PipelineError,
    bubble_fraction,
    executed_1f1b_schedule,
    executed_schedule,
    gpipe_schedule,
    one_f_one_b_schedule,
    pipeline_forward,
    pipeline_forward_fn,
    pipeline_value_and_grad,
    stash_slots,
)

CFG = dataclasses.replace(ModelConfig(), num_layers=4)  # 4 layers so pp=4 divides
B, T = 8, 12
LAYOUTS = [(2, 1, 2), (2, 2, 4), (4, 1, 4), (4, 2, 2)]  # (pp, tp, microbatches)


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, seed=0)


@pytest.fixture(scope="module")
def batch():
    tokens = np.asarray(jax.random.randint(jax.random.key(1), (B, T), 0, CFG.vocab_size), np.int32)
    mask = np.ones((B, T), np.int32)
    mask[1, 9:] = 0
    mask[6, :3] = 0  # left padding
    return tokens, mask


def _loss(logits_btv, tokens_bt, mask_bt):
    logp = jax.nn.log_softmax(logits_btv[:, :-1], axis=-1)
    nll = -jnp.take_along_axis(logp, tokens_bt[:, 1:, None], axis=-1)[..., 0]
    return jnp.sum(nll * mask_bt[:, 1:]) / jnp.sum(mask_bt[:, 1:])


def _loss_and_grads(fwd, params, tokens, mask):
    def loss(p):
        logits = fwd(p, CFG, tokens, None, mask)
        return _loss(logits, tokens, mask), logits

    return jax.value_and_grad(loss, has_aux=True)(params)


@pytest.fixture(scope="module")
def reference(params, batch):
    with jax.default_device(jax.devices()[0]):
        (loss, logits), grads = jax.jit(functools.partial(_loss_and_grads, forward))(params, *batch)
    return float(loss), np.asarray(logits), jax.tree.map(np.asarray, grads)


def _setup(params, devices, pp, tp, dp=None):
    layout = Layout(tp=tp, pp=pp)
    mesh = make_mesh(devices[: layout.size * (dp or 1)], layout, dp=dp)
    return mesh, shard_params(params, CFG, layout, mesh)


@pytest.mark.parametrize("pp,tp,m", LAYOUTS)
def test_pipeline_forward_loss_and_grads_match_pp1(params, batch, reference, devices, pp, tp, m):
    mesh, sharded = _setup(params, devices, pp, tp)
    fwd = pipeline_forward_fn(mesh, microbatches=m)
    with activation_sharding(mesh, "train"):
        (loss, logits), grads = jax.jit(functools.partial(_loss_and_grads, fwd))(sharded, *batch)
    ref_loss, ref_logits, ref_grads = reference
    np.testing.assert_allclose(np.asarray(logits), ref_logits, atol=1e-5, rtol=0)
    assert abs(float(loss) - ref_loss) < 1e-5
    assert grads["layers"]["mlp"]["w_up"].sharding.spec[0] == "pp"  # gradients laid out like the parameters
    jax.tree.map(lambda g, r: np.testing.assert_allclose(g, r, atol=1e-5, rtol=0), gather_params(grads, CFG),
                 ref_grads)


def _make_loss(forward_fn):
    """The next-token loss over a micro-batch, normalised by the whole batch's token count (``denom``), so
    micro-batches' losses sum to the batch's; the largest logit as a metric."""
    def loss(params, mb):
        logits = forward_fn(params, CFG, mb["tokens"], None, mb["mask"])
        logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
        nll = -jnp.take_along_axis(logp, mb["tokens"][:, 1:, None], axis=-1)[..., 0]
        return jnp.sum(nll * mb["mask"][:, 1:]) / mb["denom"], {"logit_max": jnp.max(logits)}

    return loss


def _pieces(batch, m):
    tokens, mask = batch
    split = lambda x: np.moveaxis(x.reshape(B // m, m, *x.shape[1:]), 1, 0)  # noqa: E731  piece i: rows i, i+m, ...
    return {"tokens": split(tokens), "mask": split(mask), "denom": np.full(m, mask[:, 1:].sum(), np.float32)}


GRID_1F1B = [(pp, tp, m) for pp in (2, 4) for tp in (1, 2) for m in (1, 2, 4, 8)]
QUICK_1F1B = [(2, 2, 8), (4, 2, 1)]  # the rest of the grid: -m long


@pytest.mark.parametrize("pp,tp,m", [g if g in QUICK_1F1B else pytest.param(*g, marks=pytest.mark.long)
                                     for g in GRID_1F1B])
def test_1f1b_loss_and_grads_match_the_plain_value_and_grad(params, batch, devices, pp, tp, m):
    """pipeline_value_and_grad against jax.value_and_grad of the same loss on the plain model (one device)."""
    pieces = _pieces(batch, m)
    whole = {"tokens": batch[0], "mask": batch[1], "denom": pieces["denom"][0]}
    with jax.default_device(devices[0]):
        (ref_loss, ref_metrics), ref_grads = jax.jit(jax.value_and_grad(_make_loss(forward), has_aux=True))(params,
                                                                                                             whole)
    mesh, sharded = _setup(params, devices, pp, tp)
    fn = jax.jit(functools.partial(pipeline_value_and_grad, _make_loss, mesh=mesh))
    (losses, metrics), grads = fn(sharded, pieces)
    assert losses.shape == (m,)  # one value per micro-batch (dp = 1)
    assert abs(float(jnp.sum(losses)) - float(ref_loss)) < 1e-5
    assert abs(float(jnp.max(metrics["logit_max"])) - float(ref_metrics["logit_max"])) < 1e-5
    assert grads["layers"]["mlp"]["w_up"].sharding.spec[0] == "pp"  # gradients laid out like the parameters
    jax.tree.map(lambda g, r: np.testing.assert_allclose(g, r, atol=1e-5, rtol=0), gather_params(grads, CFG),
                 ref_grads)


def test_1f1b_executed_schedule_is_one_forward_one_backward(params, batch, devices):
    """The running program's own record: each stage runs every micro-batch forward once and backward once,
    the last stage both in one tick, stage s's backward 2 (pp - 1 - s) ticks after its forward; at most
    2 pp - 1 micro-batches between a stage's forward and its backward."""
    pp, m = 4, 8
    mesh, sharded = _setup(params, devices, pp, 1)
    record = executed_1f1b_schedule(_make_loss, sharded, _pieces(batch, m), mesh=mesh)
    np.testing.assert_array_equal(record, one_f_one_b_schedule(pp, m))
    assert record.shape[0] == m + 2 * (pp - 1)
    for s in range(pp):
        fwd, bwd = record[:, s, 0], record[:, s, 1]
        assert sorted(fwd[fwd >= 0]) == sorted(bwd[bwd >= 0]) == list(range(m))
        lag = [int(np.flatnonzero(bwd == i)[0] - np.flatnonzero(fwd == i)[0]) for i in range(m)]
        assert lag == [2 * (pp - 1 - s)] * m
        in_flight = [len(set(fwd[: t + 1][fwd[: t + 1] >= 0]) - set(bwd[:t][bwd[:t] >= 0])) for t in range(len(fwd))]
        assert max(in_flight) <= stash_slots(pp, m) == 2 * pp - 1
    # idle halves are skipped: (pp - 1) forward-only ticks, m full ticks, (pp - 1) backward-only ticks per
    # timeline, so in units of a forward + backward the bubble is GPipe's
    assert bubble_fraction(pp, m) == pytest.approx((pp - 1) / (m + pp - 1))


@pytest.mark.parametrize("head,tie", [("value", False), ("lm", True)])
def test_pipeline_forward_value_head_and_tied_embeddings_match_pp1(batch, devices, head, tie):
    cfg = dataclasses.replace(CFG, tie_embeddings=tie)
    params = init_params(cfg, seed=2, head=head)
    ref = np.asarray(forward(params, cfg, *batch[:1], None, batch[1]))
    mesh = make_mesh(devices[:4], Layout(tp=2, pp=2))
    sharded = shard_params(params, cfg, Layout(tp=2, pp=2), mesh)
    fn = jax.jit(functools.partial(pipeline_forward, mesh=mesh, microbatches=2), static_argnums=1)
    np.testing.assert_allclose(np.asarray(fn(sharded, cfg, batch[0], None, batch[1])), ref, atol=1e-5, rtol=0)


def test_pipeline_train_step_composes_with_actor_loss(params, devices):
    """make_train_step(actor_loss) with the pipelined forward on a (dp2, pp2, tp2) mesh equals pp=1."""
    rng = np.random.default_rng(0)
    p_len, r_len, accum = 6, 6, 2
    mb = {"tokens": rng.integers(3, CFG.vocab_size, (B, p_len + r_len)).astype(np.int32),
          "mask": np.ones((B, p_len + r_len), np.int32), "response_mask": np.ones((B, r_len), np.int32),
          "old_logp": rng.normal(-3, 0.1, (B, r_len)).astype(np.float32),
          "advantages": rng.normal(size=(B, r_len)).astype(np.float32),
          "ref_logp": rng.normal(-3, 0.1, (B, r_len)).astype(np.float32), "denom": np.float32(B * r_len)}
    micro = losses.split_micro(mb, accum)
    algo = AlgorithmConfig()

    def run(params, mesh, forward_fn=losses.forward):
        loss = losses.actor_loss(CFG, algo, p_len, forward_fn)
        step = jax.jit(losses.make_train_step(loss, optax.sgd(1.0), CFG))
        spec = lambda v: PartitionSpec(None, "dp") if v.ndim > 1 and "dp" in mesh.axis_names else PartitionSpec()  # noqa: E731
        data = {k: jax.device_put(v, NamedSharding(mesh, spec(v))) for k, v in micro.items()}
        new, _, metrics = step(params, optax.sgd(1.0).init(params), data)
        return gather_params(new, CFG), float(metrics["loss"])

    ref_mesh, ref_sharded = _setup(params, devices, 1, 1)
    ref_params, ref_loss = run(ref_sharded, ref_mesh)
    mesh, sharded = _setup(params, devices, 2, 2, dp=2)
    new_params, loss = run(sharded, mesh, pipeline_forward_fn(mesh, microbatches=2))
    assert abs(loss - ref_loss) < 1e-5
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=0), new_params, ref_params)


def test_pipeline_executed_schedule_is_gpipe(params, batch, devices):
    mesh, sharded = _setup(params, devices, 4, 1)
    record = executed_schedule(sharded, CFG, batch[0], mesh=mesh, microbatches=8)
    np.testing.assert_array_equal(record, gpipe_schedule(4, 8))
    assert np.mean(record < 0) == pytest.approx(bubble_fraction(4, 8))
    assert all(sorted(record[:, s][record[:, s] >= 0]) == list(range(8)) for s in range(4))


def test_pipeline_with_pp1_is_the_plain_model(params, batch, devices):
    mesh, sharded = _setup(params, devices, 1, 2)
    assert inspect.unwrap(pipeline_forward_fn(mesh, microbatches=4)) is forward  # no pipeline, hooks only
    out = pipeline_forward(sharded, CFG, batch[0], None, batch[1], mesh=mesh, microbatches=4)
    np.testing.assert_allclose(np.asarray(out), np.asarray(forward(params, CFG, batch[0], None, batch[1])), atol=1e-5)


def test_pipeline_rejects_microbatches_not_dividing_the_batch(params, batch, devices):
    mesh, sharded = _setup(params, devices, 2, 1)
    with pytest.raises(PipelineError, match="microbatches=3 does not divide the batch of 8"):
        pipeline_forward(sharded, CFG, batch[0], mesh=mesh, microbatches=3)
    with pytest.raises(PipelineError, match="microbatches=0"):
        pipeline_forward(sharded, CFG, batch[0], mesh=mesh, microbatches=0)


def test_pipeline_rejects_pp_not_dividing_layers_or_dp_not_dividing_microbatches(params, batch, devices):
    cfg3 = dataclasses.replace(CFG, num_layers=3)
    mesh = make_mesh(devices[:2], Layout(pp=2))
    with pytest.raises(LayoutError, match="pp=2 does not divide the model's 3 layers"):
        pipeline_forward(init_params(cfg3), cfg3, batch[0], mesh=mesh, microbatches=2)
    mesh, sharded = _setup(params, devices, 2, 1, dp=4)
    with pytest.raises(PipelineError, match="micro-batches of 2 rows do not split over dp=4"):
        pipeline_forward(sharded, CFG, batch[0], mesh=mesh, microbatches=4)
