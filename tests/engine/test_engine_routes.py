"""An engine that records routes (mixture-of-experts models, for routing replay): every prompt token and every
response token it fed back carries the router's top-k per layer, and those are the full forward's own top-k of
the same sequence (float32: the forward, given the record, finds no token whose own choice differs); the last
response token (never fed back) and padding carry none. Paged caches, k decode steps per call, chunked
prefill and experts split over an expert-parallel replica (ep 4 x tp 2) generate the same tokens and record the
same routes as the plain engine; a continuation prefilled onto a slot (``prefill_slots``)
records its tokens' routes; a dense model cannot record, and conversations refuse a recording engine."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from _engine_testlib import TINY, make_engine, make_prompts

from nereus_jax.engine import Conversations, EngineError, Generator, SamplingParams, make_requests
from nereus_jax.models import forward, init_params

MOE = dataclasses.replace(TINY, family="qwen3_moe", qk_norm=True, num_experts=8, num_experts_per_tok=2,
                          moe_intermediate_size=32)
SAMPLED = SamplingParams(temperature=1.0, max_new_tokens=10, n=2, seed=3, stop_tokens=(5,))


@pytest.fixture(scope="module")
def moe_params():
    return init_params(MOE, seed=1)


def _generate(devices, params, prompts, **engine):
    e = make_engine(devices, cfg=MOE, record_routes=True, **engine)
    return Generator(e, e.load_params(params)).rollouts(prompts, SAMPLED)


def _sequences(prompts, out):
    """Each row's prompt + response tokens and recorded routes, left-aligned and right-padded."""
    rows = range(out.num_rows)
    toks = [np.concatenate([prompts[out.prompt_index[r]], out.tokens[r, :out.lengths[r]]]) for r in rows]
    routes = [np.concatenate([out.prompt_routes[r][out.prompt_routes.shape[1] - prompts[out.prompt_index[r]].size:],
                              out.routes[r, :out.lengths[r]]]) for r in rows]
    width = max(t.size for t in toks)
    tokens = np.stack([np.pad(t, (0, width - t.size)) for t in toks])
    mask = np.stack([np.arange(width) < t.size for t in toks]).astype(np.int32)
    padded = np.stack([np.pad(r, ((0, width - len(r)), (0, 0), (0, 0)), constant_values=-1) for r in routes])
    return tokens, mask, padded


def test_recorded_routes_are_the_forwards_own_top_k(devices, moe_params):
    prompts = make_prompts(5, seed=11, low=3, high=20)
    out = _generate(devices, moe_params, prompts)
    tokens, mask, routes = _sequences(prompts, out)
    recorded = np.all(routes >= 0, axis=(-2, -1))
    for r in range(out.num_rows):  # every prompt token and every response token but the last
        p, n = prompts[out.prompt_index[r]].size, int(out.lengths[r])
        np.testing.assert_array_equal(recorded[r], np.arange(tokens.shape[1]) < p + n - 1)
        assert np.all(out.prompt_routes[r, :out.prompt_routes.shape[1] - p] == -1)
    assert np.all(out.routes[np.arange(out.num_rows), out.lengths - 1] == -1)
    _, stats = forward(moe_params, MOE, jnp.asarray(tokens), None, jnp.asarray(mask), routes_btlk=jnp.asarray(routes),
                       return_routing=True)
    assert not np.asarray(stats.own_mismatch_bt).any()
    # the comparison can fail: another sequence's routes disagree
    _, other = forward(moe_params, MOE, jnp.asarray(tokens), None, jnp.asarray(mask),
                       routes_btlk=jnp.asarray(np.roll(routes, 1, axis=0)), return_routing=True)
    assert np.asarray(other.own_mismatch_bt).sum() > recorded.sum() // 4


@pytest.mark.parametrize("engine", [dict(page_size=8), dict(decode_steps_per_call=3),
                                    dict(max_prefill_length=16, max_prompt_length=30), dict(ep=4, tp=2)],
                         ids=["paged", "3-steps-per-call", "chunked-prefill", "expert-parallel"])
def test_every_engine_variant_records_the_same_routes(devices, moe_params, engine):
    prompts = make_prompts(4, seed=12, low=3, high=30)
    plain = _generate(devices, moe_params, prompts, max_prefill_length=32, max_prompt_length=32)
    other = _generate(devices, moe_params, prompts, **{"max_prompt_length": 32, **engine})
    np.testing.assert_array_equal(other.tokens, plain.tokens)
    np.testing.assert_array_equal(other.routes, plain.routes)
    width = min(other.prompt_routes.shape[1], plain.prompt_routes.shape[1])
    np.testing.assert_array_equal(other.prompt_routes[:, -width:], plain.prompt_routes[:, -width:])


def test_a_dense_model_cannot_record_routes(devices):
    with pytest.raises(EngineError, match="mixture-of-experts"):
        make_engine(devices, record_routes=True)
    out = Generator(e := make_engine(devices), e.load_params(init_params(TINY))).rollouts(make_prompts(1), SAMPLED)
    assert out.routes is None and out.prompt_routes is None


def test_prefill_slots_records_its_tokens_routes_and_conversations_refuse_to_record(devices, moe_params):
    """A continuation prefilled onto a slot's cache carries its tokens' routes, those a prefill of the whole
    sequence records at their places; conversations (whose turns would overwrite each other's) refuse such an
    engine, as the config keeps routing replay away from task.env."""
    e = make_engine(devices, cfg=MOE, record_routes=True)
    params = e.load_params(moe_params)
    prompt, extra = make_prompts(2, seed=14, low=5, high=9)
    prefix, first = e.prefill(params=params, padded_tokens=prompt, true_length=prompt.size)
    state = e.insert(prefix, e.init_decode_state(), slot=2)
    onto = np.concatenate([np.asarray(first.tokens)[0, :1], extra]).astype(np.int32)
    requests = make_requests(1, e.max_stop_tokens, limit=4)
    _, result = e.prefill_slots(params, state, [2], onto[None], [onto.size], requests)
    whole = np.concatenate([prompt, onto])
    _, full = e.prefill(params=params, padded_tokens=whole, true_length=whole.size)
    routes = np.asarray(result.routes)
    assert routes.shape[0] == 1 and routes.shape[1] >= onto.size  # [rows, the tokens' bucket, layers, k]
    np.testing.assert_array_equal(routes[0, :onto.size], np.asarray(full.routes)[0, prompt.size:whole.size])
    with pytest.raises(EngineError, match="do not record routes"):
        Conversations(Generator(e, params), [prompt], SAMPLED, park=False)
