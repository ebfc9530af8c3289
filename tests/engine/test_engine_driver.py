"""The driver: continuous vs static refill schedules, n samples per prefill, stops and limits, compile
counts over a steady workload, parameter swaps between decode steps."""

import dataclasses
import gc
import heapq
import weakref

import jax
import numpy as np
import pytest
from _engine_testlib import TINY, make_engine, make_prompts, teacher_forced_logits

from nereus_jax.engine import Generator, SamplingParams
from nereus_jax.models import init_params

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12)


def _continuous_steps(lengths, slots):
    """Decode steps of ideal continuous batching: a slot holds a row for length - 1 steps (the first token
    comes from prefill) and takes the next row as soon as it is free."""
    free_at = [0] * slots
    for length in lengths:
        heapq.heappush(free_at, heapq.heappop(free_at) + length - 1)
    return max(free_at)


def test_continuous_refill_follows_the_ideal_schedule_and_static_waits_for_the_batch(gen):
    lengths = [2, 9, 3, 3, 12, 4, 5, 2, 8, 3]
    prompts = make_prompts(len(lengths), seed=3)
    out = gen.rollouts(prompts, GREEDY, forced_lengths=lengths)
    np.testing.assert_array_equal(out.lengths, lengths)
    assert out.stats["decode_steps"] == _continuous_steps(lengths, 4)
    static = gen.rollouts(prompts, GREEDY, forced_lengths=lengths, refill="static")
    assert static.stats["decode_steps"] == sum(max(lengths[i:i + 4]) - 1 for i in range(0, len(lengths), 4))
    np.testing.assert_array_equal(static.tokens, out.tokens)  # the schedule never changes the tokens


def test_splitting_a_batch_over_calls_with_global_prompt_ids_samples_the_same_tokens(gen):
    prompts = make_prompts(6, seed=5)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=8, n=2, seed=7)
    whole = gen.rollouts(prompts, sampling)
    first = gen.rollouts(prompts[:2], sampling, prompt_ids=[0, 1])
    rest = gen.rollouts(prompts[2:], sampling, prompt_ids=[2, 3, 4, 5])
    np.testing.assert_array_equal(np.concatenate([first.tokens, rest.tokens]), whole.tokens)
    shifted = gen.rollouts(prompts[2:], sampling)  # ids 0..3: another part of the random stream
    assert not np.array_equal(shifted.tokens, whole.tokens[4:])


def test_n_samples_per_prompt_share_one_prefill(gen):
    out = gen.rollouts(make_prompts(3, seed=4), SamplingParams(temperature=1.0, max_new_tokens=6, n=4, seed=1))
    assert out.stats["prefill_rows"] == 3 and out.num_rows == 12
    np.testing.assert_array_equal(out.prompt_index, np.repeat(np.arange(3), 4))
    np.testing.assert_array_equal(out.sample_index, np.tile(np.arange(4), 3))
    assert len({tuple(out.tokens[r]) for r in range(4)}) > 1  # samples of one prompt draw independently


def test_stop_token_ends_a_row_with_reason_stop_and_limit_with_reason_length(gen, raw_params):
    prompts = make_prompts(4, seed=6)
    free = gen.rollouts(prompts, GREEDY)
    stop = int(free.tokens[0, 4])  # row 0 draws it at index 4 (or earlier)
    out = gen.rollouts(prompts, SamplingParams(temperature=0.0, max_new_tokens=12, stop_tokens=(stop,)))
    for row in range(4):
        hits = np.flatnonzero(free.tokens[row] == stop)
        length = hits[0] + 1 if hits.size else 12
        assert out.lengths[row] == length
        assert out.finish_reasons[row] == ("stop" if hits.size else "length")
        np.testing.assert_array_equal(out.tokens[row, :length], free.tokens[row, :length])
        assert np.all(out.tokens[row, length:] == gen.pad_id) and np.all(out.param_versions[row, length:] == -1)


def test_forced_lengths_ignore_stop_tokens_and_max_new_tokens_caps_length(gen):
    prompts = make_prompts(3, seed=6)
    sampling = SamplingParams(temperature=0.0, max_new_tokens=20, stop_tokens=tuple(range(TINY.vocab_size))[:4])
    out = gen.rollouts(prompts, sampling, forced_lengths=[20, 1, 7])
    np.testing.assert_array_equal(out.lengths, [20, 1, 7])
    assert out.finish_reasons == ("length",) * 3


def test_compile_count_stays_fixed_over_a_steady_workload(devices, raw_params):
    engine = make_engine(devices)
    gen = Generator(engine, engine.load_params(raw_params))
    sampling = SamplingParams(temperature=1.0, top_k=5, top_p=0.9, max_new_tokens=16, n=2, stop_tokens=(3,))
    warm_up = make_prompts(4, seed=0, low=1, high=16) + make_prompts(4, seed=1, low=17, high=32)
    gen.rollouts(warm_up, sampling)  # one prefill batch per length bucket
    compiled = dict(engine.traces)
    assert compiled["generate"] == 1 and compiled["prefill"] == len(engine.prefill_lengths) == 2
    rng = np.random.default_rng(0)
    for batch in range(3):  # any number of prompts of 1..32 tokens, forced lengths or not, other seeds
        prompts = make_prompts(int(rng.integers(1, 12)), seed=10 + batch, low=1, high=32)
        forced = rng.integers(1, 17, len(prompts)) if batch % 2 else None
        gen.rollouts(prompts, dataclasses.replace(sampling, seed=batch), forced_lengths=forced)
    assert dict(engine.traces) == compiled


def test_param_swap_between_steps_keeps_live_slots_and_records_versions(gen, engine, params, raw_params):
    prompts = make_prompts(8, seed=7)
    other_raw = init_params(TINY, seed=1)
    other = engine.load_params(other_raw)
    swap_after = 5

    def swap(g, step):
        if step == swap_after:
            g.set_params(other, version=7)

    out = gen.rollouts(prompts, GREEDY, on_step=swap)
    assert np.all(out.lengths == 12) and out.stats["param_swaps"] == 1  # no row dropped or cut
    versions = out.param_versions
    assert set(np.unique(versions)) == {0, 7}
    assert np.all(np.diff(versions, axis=1)[:, :11] >= 0)  # each row: old params, then new
    straddling = [r for r in range(8) if versions[r, 0] == 0 and versions[r, -1] == 7]
    assert straddling and np.sum(versions[0] == 0) == 1 + swap_after  # row 0: prefill + 5 steps on version 0
    before = Generator(engine, params).rollouts(prompts, GREEDY)
    for r in range(8):
        old = versions[r] == 0
        np.testing.assert_array_equal(out.tokens[r, old], before.tokens[r, old])
    fresh = [r for r in range(8) if versions[r, 0] == 7]  # prefilled after the swap: all new params
    assert fresh
    for r, logits in zip(fresh, teacher_forced_logits(other_raw, TINY, [prompts[r] for r in fresh],
                                                      _rows(out, fresh)), strict=True):
        np.testing.assert_array_equal(out.tokens[r], np.argmax(logits, -1))


def test_params_set_between_calls_replace_the_old_ones_at_once(engine, params):
    """No call running: the old parameters are dropped by set_params itself (not held beside the new ones
    until the next call: a second copy of the weights), and the next call runs on the new ones throughout."""
    gen = Generator(engine, engine.load_params(init_params(TINY, seed=2)))
    old = weakref.ref(jax.tree.leaves(gen._params)[0])
    gen.set_params(params, version=4)
    gc.collect()
    assert old() is None and gen.version == 4
    prompts = make_prompts(3, seed=1)
    out = gen.rollouts(prompts, GREEDY)
    assert np.all(out.param_versions == 4) and out.stats.get("param_swaps", 0) == 0
    np.testing.assert_array_equal(out.tokens, Generator(engine, params).rollouts(prompts, GREEDY).tokens)


def _rows(out, rows):
    """``out`` restricted to ``rows`` (renumbered as prompts 0..len-1), for teacher_forced_logits."""
    class View:
        num_rows = len(rows)
        prompt_index = np.arange(len(rows))
        tokens, lengths = out.tokens[rows], out.lengths[rows]
    return View


@pytest.mark.parametrize("prompts,kwargs,message", [
    ([np.arange(33)], {}, "max_prefill_length=32"),
    ([[]], {}, "prompt 0 has 0 tokens"),
    ([[5, 200]], {}, "outside the vocabulary"),
    ([np.arange(30)], {"sampling": SamplingParams(max_new_tokens=40)}, "exceeds max_target_length=64"),
    ([[1, 2]], {"forced_lengths": [3, 4]}, "forced_lengths needs one length"),
    ([[1, 2]], {"forced_lengths": [13]}, "forced_lengths needs one length"),
    ([[1, 2]], {"sampling": SamplingParams(stop_tokens=(1, 2, 3, 4, 5))}, "max_stop_tokens=4"),
    ([[1, 2]], {"refill": "eager"}, "refill must be"),
])
def test_bad_generate_input_raises_a_clear_error(gen, prompts, kwargs, message):
    from nereus_jax.engine import EngineError

    sampling = kwargs.pop("sampling", GREEDY)
    with pytest.raises(EngineError, match=message):
        gen.rollouts(prompts, sampling, **kwargs)


@pytest.mark.parametrize("kwargs,message", [
    ({"temperature": -1.0}, "temperature must be >= 0"),
    ({"top_p": 0.0}, "top_p must be in"),
    ({"top_k": -2}, "top_k must be >= 0"),
    ({"n": 0}, "n .samples per prompt. must be >= 1"),
    ({"max_new_tokens": 0}, "max_new_tokens must be >= 1"),
])
def test_bad_sampling_params_raise_a_clear_error(kwargs, message):
    from nereus_jax.engine import SamplingError

    with pytest.raises(SamplingError, match=message):
        SamplingParams(**kwargs)


def test_generator_state_survives_calls_and_returns_numpy(gen):
    out = gen.rollouts([[1, 2, 3]], SamplingParams(temperature=0.0, max_new_tokens=3))
    assert isinstance(out.tokens, np.ndarray) and out.tokens.dtype == np.int32
    assert not bool(np.any(jax.device_get(gen._state.active)))
