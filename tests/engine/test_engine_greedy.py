"""Greedy generation against a full uncached forward, across tp layouts and slot counts."""

import jax
import numpy as np
import pytest
from _engine_testlib import TINY, make_engine, make_prompts, teacher_forced_logits

from nereus_jax.engine import Generator, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12)


@pytest.fixture(scope="module")
def prompts():
    return make_prompts(10, seed=1)  # more prompts than the 4 slots: slots refill while others decode


@pytest.fixture(scope="module")
def greedy_out(engine, params, prompts):
    return Generator(engine, params).rollouts(prompts, GREEDY)


@pytest.fixture(scope="module")
def reference(raw_params, prompts, greedy_out):
    return teacher_forced_logits(raw_params, TINY, prompts, greedy_out)


def test_greedy_tokens_equal_argmax_of_full_forward_over_growing_sequence(greedy_out, reference):
    assert np.all(greedy_out.lengths == GREEDY.max_new_tokens)
    for row, logits in enumerate(reference):
        np.testing.assert_array_equal(greedy_out.tokens[row, : greedy_out.lengths[row]], np.argmax(logits, -1))


def test_logprobs_equal_full_forward_log_softmax(greedy_out, reference):
    for row, logits in enumerate(reference):
        length = greedy_out.lengths[row]
        logp = np.asarray(jax.nn.log_softmax(logits, -1))
        want = logp[np.arange(length), greedy_out.tokens[row, :length]]
        np.testing.assert_allclose(greedy_out.logprobs[row, :length], want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("tp", [2, 4])
def test_greedy_tokens_identical_for_tp_1_2_4(devices, raw_params, prompts, greedy_out, tp):
    engine = make_engine(devices, tp=tp)
    out = Generator(engine, engine.load_params(raw_params)).rollouts(prompts, GREEDY)
    np.testing.assert_array_equal(out.tokens, greedy_out.tokens)
    np.testing.assert_allclose(out.logprobs, greedy_out.logprobs, atol=1e-5)
    cache = engine.init_decode_state().caches[0][0]
    kv_per_device = {s.data.shape[1] for s in cache.addressable_shards}
    assert cache.shape[1] == max(TINY.num_kv_heads, tp) and kv_per_device == {cache.shape[1] // tp}


def test_greedy_tokens_identical_for_one_and_many_slots(devices, raw_params, prompts, greedy_out):
    engine = make_engine(devices, max_concurrent_decodes=1, max_prefill_batch=1)
    out = Generator(engine, engine.load_params(raw_params)).rollouts(prompts, GREEDY)
    np.testing.assert_array_equal(out.tokens, greedy_out.tokens)
    assert out.stats["decode_steps"] == sum(greedy_out.lengths - 1)  # one slot: strictly one row at a time
