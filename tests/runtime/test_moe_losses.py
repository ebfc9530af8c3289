"""Mixture-of-experts training, against references written without the decoder (tests/models/moe_reference.py):

- ``algorithm.router_aux_coef``: the update adds the coefficient times transformers' load-balancing loss of
  each micro-batch, weighted by its share of the response tokens (one micro-batch: transformers' value), in the
  loss, the metric and the gradient (SGD with no clipping, so the update is the gradient);
- ``algorithm.routing_replay``: the update is the update of a model whose router is overridden to choose the
  recorded routes, over dp replicas too, and not the update without them;
- packed scoring replays and compares the routes as padded scoring does;
- the 1F1B pipeline schedule replays them as the plain model does (padded and packed, with dp).
"""

import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from nereus_jax.config import AlgorithmConfig, ModelConfig
from nereus_jax.models import init_params
from nereus_jax.rl import packing
from nereus_jax.runtime.step import losses
from nereus_jax.runtime.step.losses import actor_loss, make_train_step, split_micro, split_packed
from nereus_jax.runtime.step.stages import infer_program
from nereus_jax.sharding import Layout, gather_params, make_mesh, shard_params

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from moe_reference import hf_load_balancing_loss, overridden_router_forward, random_routes  # noqa: E402

MOE = ModelConfig(family="qwen3_moe", qk_norm=True, vocab_size=64, hidden_size=32, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2)
P, R, B = 5, 4, 8


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    plen, rlen = rng.integers(2, P + 1, size=B), rng.integers(1, R + 1, size=B)
    prompt_mask = (np.arange(P)[None] >= P - plen[:, None]).astype(np.int32)
    resp_mask = (np.arange(R)[None] < rlen[:, None]).astype(np.int32)
    mask = np.concatenate([prompt_mask, resp_mask], 1)
    return {"tokens": rng.integers(3, MOE.vocab_size, size=(B, P + R)).astype(np.int32) * mask, "mask": mask,
            "response_mask": resp_mask, "old_logp": rng.normal(-3, 0.1, size=(B, R)).astype(np.float32),
            "advantages": rng.normal(size=(B, R)).astype(np.float32) * resp_mask,
            "ref_logp": rng.normal(-3, 0.1, size=(B, R)).astype(np.float32), "denom": np.float32(resp_mask.sum()),
            "routes": np.asarray(random_routes(MOE, B, P + R, seed=seed + 1)) * mask[..., None, None]
            - (1 - mask[..., None, None])}


def _step(params, batch, loss, devices, dp=1, accum=1):
    """One update on a dp mesh: SGD at rate 1 and no gradient clipping, so new = old - gradient."""
    mesh = make_mesh(devices[:dp], Layout(), dp=dp)
    sharded = shard_params(params, MOE, Layout(), mesh)
    opt = optax.sgd(1.0)
    data = {k: jax.device_put(v, NamedSharding(mesh, PartitionSpec(None, "dp") if v.ndim > 1 else PartitionSpec()))
            for k, v in split_micro(batch, accum).items()}
    new, _, metrics = jax.jit(make_train_step(loss, opt, MOE, max_grad_norm=1e9))(sharded, opt.init(sharded), data)
    return gather_params(new, MOE), jax.tree.map(float, metrics)


@pytest.fixture(scope="module")
def params():
    return init_params(MOE, seed=0)


# accum 2: ~26 s (CI time; run with -m long)
@pytest.mark.parametrize("accum", [1, pytest.param(2, marks=pytest.mark.long)])
def test_router_aux_loss_adds_the_coefficient_times_transformers_loss_per_micro_batch(params, devices, accum):
    batch, coef = _batch(), 0.05
    plain = actor_loss(MOE, AlgorithmConfig(), P)
    new0, m0 = _step(params, batch, plain, devices, accum=accum)
    new, m = _step(params, batch, actor_loss(MOE, AlgorithmConfig(router_aux_coef=coef), P), devices, accum=accum)

    def reference(p):  # each micro-batch's loss, weighted by its response tokens
        total = 0.0
        for rows in np.split(np.arange(B), accum):
            gate_logits = overridden_router_forward(p, MOE, batch["tokens"][rows], batch["mask"][rows])[1]
            share = batch["response_mask"][rows].sum() / batch["denom"]
            total = total + share * hf_load_balancing_loss(gate_logits, jnp.asarray(batch["mask"][rows]),
                                                           MOE.num_experts_per_tok)
        return total

    want = float(reference(params))
    np.testing.assert_allclose(m["router_aux_loss"], want, rtol=1e-5)
    np.testing.assert_allclose(m["loss"] - m0["loss"], coef * want, rtol=1e-4)
    # SGD at rate 1: the difference of the two updates is -coef x the reference's gradient
    grad = jax.grad(reference)(params)
    for name in ("router", "w_gate"):
        got = np.asarray(new["layers"]["moe"][name]) - np.asarray(new0["layers"]["moe"][name])
        want_g = -coef * np.asarray(grad["layers"]["moe"][name])
        assert np.abs(want_g).max() > 0 or name == "w_gate"
        np.testing.assert_allclose(got, want_g, atol=1e-6 + 1e-4 * np.abs(want_g).max(), rtol=0)


@pytest.mark.parametrize("dp", [1, 2])
def test_the_update_replays_the_recorded_routes(params, devices, dp):
    batch = _batch(seed=3)
    routes = jnp.asarray(batch["routes"])

    def overridden(p, cfg, tokens, positions=None, mask=None, *, return_hidden=False):
        return overridden_router_forward(p, cfg, tokens, mask, routes, return_hidden=return_hidden)[0]

    new, m = _step(params, batch, actor_loss(MOE, AlgorithmConfig(routing_replay=True), P), devices, dp=dp)
    want, m_ref = _step(params, {k: v for k, v in batch.items() if k != "routes"},
                        actor_loss(MOE, AlgorithmConfig(), P, overridden), devices)
    own, _ = _step(params, batch, actor_loss(MOE, AlgorithmConfig(), P), devices, dp=dp)
    np.testing.assert_allclose(m["loss"], m_ref["loss"], rtol=1e-5)
    # the updates (new - old), each leaf to 1e-3 of its largest entry: they are ~1e-4, the weights ~2e-2
    update = lambda t: jax.tree.map(lambda a, b: np.asarray(a, np.float64) - np.asarray(b), t, params)  # noqa: E731
    for a, b in zip(*(jax.tree.leaves(update(t)) for t in (new, want)), strict=True):
        scale = np.abs(b).max()
        np.testing.assert_allclose(a, b, atol=1e-3 * scale, rtol=0)
    router = lambda t: update(t)["layers"]["moe"]["router"]  # noqa: E731
    assert np.abs(router(new) - router(own)).max() > 0.1 * np.abs(router(new)).max()  # without the routes: another


def test_packed_scoring_replays_and_compares_routes_as_padded(params):
    batch = _batch(seed=5)
    data = {k: batch[k] for k in ("tokens", "mask", "routes")}
    program = infer_program(MOE, P, "logprobs", replay=True)
    *padded, padded_counts = program(params, split_micro(data, 1))  # + each layer's per-expert pair counts
    padded = [np.asarray(x).reshape(B, R) for x in padded]
    layout = packing.pack(data["tokens"], data["mask"], prompt_len=P, mini=1, dp=1, budget_rows=3)
    assert layout.accum > 1 or layout.rows < B  # rows were really packed
    *packed, packed_counts = program(params, split_packed(data, layout))
    packed = [np.asarray(x).reshape(B, R)[np.argsort(layout.order)] for x in packed]
    np.testing.assert_array_equal(np.sum(packed_counts, axis=0), np.sum(padded_counts, axis=0))  # the same load
    real = batch["response_mask"] > 0
    np.testing.assert_allclose(packed[0][real], padded[0][real], atol=1e-5, rtol=0)
    for a, b in zip(packed[1:], padded[1:], strict=True):
        np.testing.assert_array_equal(a * real, b * real)
    assert (padded[2] * real).sum() > 0 and (padded[1] * real).sum() == 0  # replayed: own choices differ, used don't


@pytest.mark.parametrize("packed,dp,m", [(False, 1, 2), (True, 2, 2)])
def test_1f1b_replays_the_recorded_routes_as_the_plain_model(params, devices, packed, dp, m):
    """losses.pipelined_value_and_grad (the job's pp > 1 train step under 1F1B) with routing replay against
    jax.value_and_grad of the same loss on the plain model: loss, metrics and every gradient."""
    batch = _batch(seed=6)
    if packed:
        layout = packing.pack(batch["tokens"], batch["mask"], prompt_len=P, mini=1, dp=dp, budget_rows=2, quantum=2)
        per_sequence = {k: v for k, v in batch.items() if k != "denom"}  # split_packed adds the normalisers
        mb = jax.tree.map(lambda v: v[0, 0], split_packed(per_sequence, layout, 1))
    else:
        mb = {k: np.asarray(v) for k, v in batch.items()}
    make_loss = functools.partial(actor_loss, MOE, AlgorithmConfig(routing_replay=True), P)
    reference = jax.jit(jax.value_and_grad(make_loss(losses.forward), has_aux=True))
    (ref_loss, ref_metrics), ref_grads = reference(params, mb)
    layout = Layout(pp=2)
    mesh = make_mesh(devices[: layout.size * dp], layout, dp=dp)
    (loss, metrics), grads = jax.jit(losses.pipelined_value_and_grad(make_loss, mesh, m))(
        shard_params(params, MOE, layout, mesh), mb)
    close = lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)  # noqa: E731
    close(loss, ref_loss)
    jax.tree.map(close, metrics, ref_metrics)
    jax.tree.map(close, gather_params(grads, MOE), ref_grads)
    plain = jax.jit(jax.value_and_grad(functools.partial(actor_loss, MOE, AlgorithmConfig(), P)(losses.forward),
                                       has_aux=True))(params, mb)
    assert abs(float(plain[0][0]) - float(ref_loss)) > 1e-6  # the routes change the loss
