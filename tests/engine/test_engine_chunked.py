"""Several decode steps per engine call (``decode_steps_per_call=k``): the same tokens, log-probabilities,
lengths, finish reasons and parameter versions as one step per call, with stop tokens and rows of
different lengths, greedy and sampled; swaps land between calls."""

import numpy as np
import pytest
from _engine_testlib import TINY, make_engine, make_prompts
from _engine_testlib import assert_same_generation as _assert_same

from nereus_jax.config import ConfigError, load_config
from nereus_jax.engine import EngineError, Generator, SamplingParams
from nereus_jax.models import init_params

K = 4


@pytest.fixture(scope="module")
def chunked(devices, raw_params):
    engine = make_engine(devices, decode_steps_per_call=K)
    return engine, engine.load_params(raw_params)


def _stop_token(gen, prompts, sampling):
    """A token some rows draw mid-response (so stops end rows at different steps)."""
    free = gen.rollouts(prompts, sampling)
    return int(free.tokens[0, 3])


@pytest.mark.parametrize("sampling", [
    SamplingParams(temperature=0.0, max_new_tokens=12),
    SamplingParams(temperature=1.0, top_k=20, top_p=0.95, max_new_tokens=12, n=3, seed=11),
], ids=["greedy", "sampled"])
def test_k_steps_per_call_give_the_tokens_of_one_step_per_call(gen, chunked, sampling):
    prompts = make_prompts(7, seed=21)
    stop = _stop_token(gen, prompts, sampling)
    with_stop = SamplingParams(**{**sampling.__dict__, "stop_tokens": (stop,)})
    one = gen.rollouts(prompts, with_stop)
    many = Generator(*chunked).rollouts(prompts, with_stop)
    assert len(set(one.lengths.tolist())) > 1 and "stop" in one.finish_reasons and "length" in one.finish_reasons
    _assert_same(many, one)
    assert many.stats["decode_calls"] < one.stats["decode_steps"]
    assert many.stats["decode_steps"] >= one.stats["decode_steps"]  # slots refill later: never fewer steps


def test_forced_lengths_and_static_refill_match_one_step_per_call(gen, chunked):
    prompts = make_prompts(9, seed=22)
    lengths = [1, 2, 9, 4, 12, 5, 3, 7, 6]  # not multiples of K, some shorter than a call
    sampling = SamplingParams(temperature=1.0, max_new_tokens=12, seed=3)
    for refill in ("continuous", "static"):
        one = gen.rollouts(prompts, sampling, forced_lengths=lengths, refill=refill)
        many = Generator(*chunked).rollouts(prompts, sampling, forced_lengths=lengths, refill=refill)
        _assert_same(many, one)
        np.testing.assert_array_equal(many.lengths, lengths)


def test_compiles_one_chunked_program_and_never_the_single_step(devices, raw_params):
    engine = make_engine(devices, decode_steps_per_call=K)
    gen = Generator(engine, engine.load_params(raw_params))
    for seed in range(3):
        gen.rollouts(make_prompts(5, seed=seed), SamplingParams(temperature=1.0, max_new_tokens=10, seed=seed))
    assert engine.traces["generate_steps"] == 1 and engine.traces["generate"] == 0


def test_param_swap_lands_at_the_next_call_boundary(chunked):
    engine, params = chunked
    other = engine.load_params(init_params(TINY, seed=1))
    swaps = []

    def swap(g, step):
        swaps.append(step)
        if len(swaps) == 2:  # after the second call (2 * K steps)
            g.set_params(other, version=5)

    out = Generator(engine, params).rollouts(make_prompts(8, seed=23), SamplingParams(temperature=0.0,
                                                                                       max_new_tokens=12),
                                             on_step=swap)
    assert swaps[:2] == [K, 2 * K] and out.stats["param_swaps"] == 1
    assert np.sum(out.param_versions[0] == 0) == 1 + 2 * K  # row 0: prefill + two calls on version 0
    assert np.all(out.lengths == 12)


def test_decode_steps_per_call_must_be_positive(devices):
    with pytest.raises(EngineError, match="decode_steps_per_call must be >= 1, got 0"):
        make_engine(devices, decode_steps_per_call=0)
    with pytest.raises(ConfigError, match=r"rollout\.decode_steps_per_call must be > 0, got 0"):
        load_config(None, ["rollout.decode_steps_per_call=0"])
    assert load_config(None, ["rollout.decode_steps_per_call=8"]).rollout.decode_steps_per_call == 8


def test_k_steps_per_call_on_a_tp2_mesh_match_one_step_per_call(devices, raw_params):
    prompts = make_prompts(6, seed=24)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=10, n=2, seed=4, stop_tokens=(7, 19))
    outs = []
    for k in (1, K):
        engine = make_engine(devices, tp=2, decode_steps_per_call=k)
        outs.append(Generator(engine, engine.load_params(raw_params)).rollouts(prompts, sampling))
    _assert_same(outs[1], outs[0])
