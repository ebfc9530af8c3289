"""Sampling against the model's probabilities (chi-square), top-k / top-p sets, seeds and slot independence."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _engine_testlib import TINY, make_engine, make_prompts, teacher_forced_logits
from scipy import stats

from nereus_jax.engine import Generator, SamplingParams, make_requests, sample
from nereus_jax.models import forward, init_params

SMALL_VOCAB = dataclasses.replace(TINY, vocab_size=16)
_sample = jax.jit(sample)


def _draw(logits_nv, **request):
    n = logits_nv.shape[0]
    requests = jax.tree.map(jnp.asarray, make_requests(n, 1, seed=7, prompt=np.arange(n), **request))
    tokens, logprobs = _sample(jnp.asarray(logits_nv, jnp.float32), requests, jnp.zeros(n, jnp.int32))
    return np.asarray(tokens), np.asarray(logprobs)


def _chi_square_p(tokens, probs):
    counts = np.bincount(tokens, minlength=probs.size)
    keep = probs > 0
    assert counts[~keep].sum() == 0, "drew a zero-probability token"
    return stats.chisquare(counts[keep], probs[keep] / probs[keep].sum() * tokens.size).pvalue


@pytest.fixture(scope="module")
def peaked_params():
    params = init_params(SMALL_VOCAB, seed=3)
    params["lm_head"]["kernel"] = params["lm_head"]["kernel"] * 8.0  # logits with std ~1.3: a shaped distribution
    return params


def test_first_token_frequencies_match_model_probabilities_chi_square(devices, peaked_params):
    engine = make_engine(devices, cfg=SMALL_VOCAB, max_prefill_batch=1)
    prompt = np.array([3, 1, 4, 1, 5, 9, 2, 6], np.int32)
    requests = make_requests(1, engine.max_stop_tokens, seed=0, temperature=1.0, limit=2)
    _, first = engine.prefill(params=engine.load_params(peaked_params), padded_tokens=prompt, true_length=8,
                              requests=requests, num_samples=6000)
    tokens = np.asarray(first.tokens[0])
    logits = np.asarray(forward(peaked_params, SMALL_VOCAB, jnp.asarray(prompt)[None])[0, -1], np.float64)
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    assert probs.max() < 0.5 and np.sum(probs > 0.01) >= 8  # the test distribution is neither flat nor one-hot
    assert _chi_square_p(tokens, probs) > 1e-3
    hotter = probs**0.5 / np.sum(probs**0.5)  # the same draws are far from the temperature-2 distribution
    assert _chi_square_p(tokens, hotter) < 1e-6


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_scales_logits_before_sampling_chi_square(temperature):
    logits = np.linspace(-2.0, 2.0, 12)
    tokens, logprobs = _draw(np.tile(logits, (6000, 1)), temperature=temperature)
    probs = np.exp(logits / temperature) / np.sum(np.exp(logits / temperature))
    assert _chi_square_p(tokens, probs) > 1e-3
    np.testing.assert_allclose(logprobs, np.log(probs[tokens]), atol=1e-5)


def test_top_k_keeps_the_renormalised_top_k_distribution_chi_square():
    logits = np.linspace(-1.5, 1.5, 10)
    tokens, _ = _draw(np.tile(logits, (6000, 1)), temperature=1.0, top_k=4)
    probs = np.where(logits >= np.sort(logits)[-4], np.exp(logits), 0.0)
    assert _chi_square_p(tokens, probs) > 1e-3


def _allowed(logits, top_k, top_p):
    order = np.argsort(-logits)
    keep = np.zeros(logits.size, bool)
    ranked = logits[order] if top_k == 0 else logits[order][:top_k]
    probs = np.exp(ranked - ranked.max())
    probs /= probs.sum()
    size = np.searchsorted(np.cumsum(probs), top_p) + 1 if top_p < 1 else ranked.size
    keep[order[:size]] = True
    return keep


def test_top_k_and_top_p_never_emit_a_token_outside_the_allowed_set():
    rng = np.random.default_rng(0)
    n, vocab = 3000, 64
    logits = rng.normal(0.0, 2.0, (n, vocab))
    top_k = np.where(rng.random(n) < 0.3, 0, rng.integers(1, 12, n))
    top_p = np.where(rng.random(n) < 0.3, 1.0, rng.uniform(0.2, 0.95, n))
    top_p[top_k == 0] = np.minimum(top_p[top_k == 0], 0.9)  # every row filters by something
    tokens, _ = _draw(logits, temperature=1.0, top_k=top_k, top_p=top_p.astype(np.float32))
    allowed = np.stack([_allowed(logits[i], top_k[i], np.float32(top_p[i])) for i in range(n)])
    assert np.all(allowed[np.arange(n), tokens])
    assert len(np.unique(tokens[top_k == 0])) > 20  # and the sampler is not just greedy


def test_top_k_through_the_driver_emits_only_the_models_top_k_tokens(engine, params, raw_params):
    prompts = make_prompts(6, seed=5)
    out = Generator(engine, params).rollouts(prompts, SamplingParams(temperature=1.5, top_k=3, max_new_tokens=10))
    for row, logits in enumerate(teacher_forced_logits(raw_params, TINY, prompts, out)):
        top3 = np.argsort(-logits, axis=-1)[:, :3]
        assert np.all(np.any(top3 == out.tokens[row, : out.lengths[row], None], axis=-1))


@pytest.fixture(scope="module")
def sampled(engine, params):
    prompts = make_prompts(6, seed=2)
    run = lambda seed: Generator(engine, params).rollouts(  # noqa: E731
        prompts, SamplingParams(temperature=1.0, max_new_tokens=10, n=2, seed=seed))
    return prompts, run(11), run(11), run(12)


def test_same_seed_gives_same_tokens_and_another_seed_differs(sampled):
    _, first, again, other = sampled
    np.testing.assert_array_equal(first.tokens, again.tokens)
    np.testing.assert_array_equal(first.logprobs, again.logprobs)
    assert np.mean(first.tokens != other.tokens) > 0.5
    assert np.mean(first.tokens[0::2] != first.tokens[1::2]) > 0.5  # the n samples of a prompt differ


def test_samples_do_not_depend_on_slot_count_or_prefill_batch(devices, raw_params, sampled):
    prompts, first, _, _ = sampled
    engine = make_engine(devices, max_concurrent_decodes=3, max_prefill_batch=1)
    out = Generator(engine, engine.load_params(raw_params)).rollouts(
        prompts, SamplingParams(temperature=1.0, max_new_tokens=10, n=2, seed=11))
    np.testing.assert_array_equal(out.tokens, first.tokens)
