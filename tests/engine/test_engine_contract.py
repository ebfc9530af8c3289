"""The JetStream contract: names, properties, shardings, the engine's own model path against forward(),
prefill after an existing prefix, and clear errors for requests the engine cannot serve."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _engine_testlib import TINY, make_engine

from nereus_jax.engine import Engine, EngineError, JaxEngine, decode, make_requests
from nereus_jax.models import forward
from nereus_jax.sharding import Layout, LayoutError, make_mesh

_run = jax.jit(decode.run, static_argnums=1)


def test_jax_engine_follows_the_jetstream_engine_contract(engine):
    assert isinstance(engine, Engine)
    assert (engine.max_concurrent_decodes, engine.max_prefill_length, engine.samples_per_slot) == (4, 32, 1)
    assert engine.mesh.axis_names == ("pp", "tp") and engine.get_tokenizer() is None
    for name in ("prefill", "generate", "insert", "load_params", "init_decode_state",
                 "get_prefix_destination_sharding"):
        assert callable(getattr(engine, name))


def test_prefill_returns_a_prefix_with_the_destination_sharding(devices, raw_params):
    engine = make_engine(devices, tp=2)
    prefix, first = engine.prefill(params=engine.load_params(raw_params), padded_tokens=np.arange(1, 6),
                                   true_length=5)
    want = engine.get_prefix_destination_sharding()
    for array, sharding in zip(jax.tree.leaves(prefix), jax.tree.leaves(want), strict=True):
        assert array.sharding.is_equivalent_to(sharding, array.ndim)
    assert prefix.caches[0][0].sharding.spec[1] == "tp" and first.tokens.shape == (1, 1)


def test_prefill_computing_only_the_last_tokens_output_equals_full_forward(raw_params):
    params = decode.unstack_layers(raw_params)
    tokens = jax.random.randint(jax.random.key(1), (3, 9), 0, TINY.vocab_size)
    last = jnp.array([8, 3, 5])
    caches = decode.empty_caches(TINY, 3, 9, TINY.num_kv_heads, jnp.float32)
    hidden, trimmed = _run(params, TINY, tokens, jnp.zeros(3, jnp.int32), caches, only_b=last)
    _, full_caches = _run(params, TINY, tokens, jnp.zeros(3, jnp.int32), caches)
    want = np.asarray(forward(raw_params, TINY, tokens))[np.arange(3), np.asarray(last)]
    np.testing.assert_allclose(np.asarray(decode.logits(params, hidden[:, 0])), want, atol=1e-5, rtol=0)
    for (k, v), (fk, fv) in zip(trimmed, full_caches, strict=True):  # every token's keys and values are kept
        np.testing.assert_array_equal(np.asarray(k), np.asarray(fk))
        np.testing.assert_array_equal(np.asarray(v), np.asarray(fv))


def test_prefill_after_an_existing_prefix_equals_one_prefill_of_both(engine, params, raw_params):
    a, b = np.array([4, 8, 15, 16, 23]), np.array([42, 7, 9])
    whole, first = engine.prefill(params=params, padded_tokens=np.concatenate([a, b]), true_length=8)
    head, _ = engine.prefill(params=params, padded_tokens=np.pad(a, (0, 3)), true_length=5)
    tail, second = engine.prefill(params=params, existing_prefix=head, padded_tokens=b, true_length=3)
    np.testing.assert_array_equal(np.asarray(second.tokens), np.asarray(first.tokens))
    np.testing.assert_allclose(np.asarray(second.logprobs), np.asarray(first.logprobs), atol=1e-5)
    assert int(tail.lengths[0]) == 8
    np.testing.assert_allclose(np.asarray(tail.caches[0][0][0, :, :8]), np.asarray(whole.caches[0][0][0, :, :8]),
                               atol=1e-5)


def test_generate_tokens_come_from_the_live_slots_only(engine, params):
    state = engine.init_decode_state()
    prefix, first = engine.prefill(params=params, padded_tokens=np.array([1, 2, 3]), true_length=3)
    state = engine.insert(prefix, state, 2)
    state, result = engine.generate(params, state)
    np.testing.assert_array_equal(np.asarray(result.valid), [False, False, True, False])
    assert int(result.lengths[2]) == 2 and int(state.lengths[2]) == 4


@pytest.mark.parametrize("tp", [1, 2])
def test_insert_many_equals_one_insert_per_sample_bit_for_bit(devices, tp, raw_params):
    engine = make_engine(devices, tp=tp)
    params = engine.load_params(raw_params)
    requests = make_requests(2, engine.max_stop_tokens, seed=3, prompt=np.array([5, 9]), temperature=1.0,
                             limit=np.array([7, 2]), stop_tokens=[11])
    prefix, _ = engine.prefill(params=params, padded_tokens=np.array([[1, 2, 3, 4], [5, 6, 7, 0]]),
                               true_length=[4, 3], requests=requests, num_samples=3)
    state = engine.init_decode_state()
    state = engine.insert(prefix, state, 1, row=0, sample=0)  # a slot the batch leaves alone
    placed = [(3, 1, 2), (0, 0, 1), (2, 1, 0)]  # (slot, row, sample), slots in any order
    one = jax.tree.map(jnp.copy, state)
    for slot, row, sample in placed:
        one = engine.insert(prefix, one, slot, row=row, sample=sample)
    many = engine.insert_many(prefix, state, *zip(*placed, strict=True))
    for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(many), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # and the next decode step sees the same thing
    _, r1 = engine.generate(params, one)
    _, r2 = engine.generate(params, many)
    for a, b in zip(r1, r2, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("slots,rows,samples,message", [
    ([0, 0], [0, 0], [0, 0], "must be distinct"),
    ([4], [0], [0], "must be distinct and in"),
    ([0], [1], [0], "out of range"),
    ([0, 1], [0], [0, 0], "triples of equal length"),
])
def test_insert_many_rejects_bad_triples(engine, params, slots, rows, samples, message):
    prefix, _ = engine.prefill(params=params, padded_tokens=np.arange(3), true_length=3)
    with pytest.raises(EngineError, match=message):
        engine.insert_many(prefix, engine.init_decode_state(), slots, rows, samples)


@pytest.mark.parametrize("call,message", [
    (lambda e, p: e.prefill(params=p, padded_tokens=np.arange(40), true_length=40), "max_prefill_length=32"),
    (lambda e, p: e.prefill(params=p, padded_tokens=np.arange(5), true_length=6), "true_length must be in"),
    (lambda e, p: e.prefill(params=p, padded_tokens=np.arange(5) * 100, true_length=5), "vocabulary"),
    (lambda e, p: e.prefill(params=p, padded_tokens=np.ones((5, 3), int), true_length=3), "max_prefill_batch=4"),
    (lambda e, p: e.prefill(params=p, padded_tokens=np.arange(3), true_length=3, num_samples=0), "num_samples"),
    (lambda e, p: e.insert(e.prefill(params=p, padded_tokens=np.arange(3), true_length=3)[0],
                           e.init_decode_state(), 4), "slot 4 is out of range"),
    (lambda e, p: e.insert(e.prefill(params=p, padded_tokens=np.arange(3), true_length=3)[0],
                           e.init_decode_state(), 0, sample=1), "row 0, sample 1 is out of range"),
    (lambda e, p: e.load_params({"embed": {}}), "do not match the engine's model config"),
])
def test_requests_the_engine_cannot_serve_raise_a_clear_error(engine, params, call, message):
    with pytest.raises(EngineError, match=message):
        call(engine, params)


def test_layouts_the_engine_cannot_run_are_rejected(devices):
    with pytest.raises(EngineError, match="pp=1"):
        JaxEngine(TINY, make_mesh(devices[:2], Layout(tp=1, pp=2)))
    with pytest.raises(LayoutError, match="tp=3"):
        JaxEngine(TINY, make_mesh(devices[:3], Layout(tp=3)))
    with pytest.raises(EngineError, match="max_target_length"):
        JaxEngine(TINY, max_prefill_length=64, max_target_length=32)
    with pytest.raises(LayoutError, match="vocab"):
        JaxEngine(dataclasses.replace(TINY, vocab_size=126), make_mesh(devices[:4], Layout(tp=4)))
