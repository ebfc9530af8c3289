"""Prompts longer than ``max_prefill_length`` (up to ``max_prompt_length``) are prefilled in chunks onto a
growing prefix: the greedy tokens are the argmax over the growing sequence, sampled ones match an engine
that prefills the whole prompt at once (log-probabilities to float rounding), paged or not; prompts the
chunks cannot fit are refused with a message naming the limit."""

import numpy as np
import pytest
from _engine_testlib import TINY, make_engine, make_prompts, teacher_forced_logits

from nereus_jax.engine import EngineError, Generator, SamplingParams

CHUNKED = dict(max_prefill_length=16, max_prompt_length=40, max_target_length=64)
SAMPLED = SamplingParams(temperature=1.0, top_k=20, max_new_tokens=12, n=2, seed=5, stop_tokens=(9,))


def _prompts():
    return make_prompts(5, seed=51, low=3, high=40) + [np.arange(1, 41) % 128, np.arange(7, 40) % 128]


@pytest.mark.parametrize("page_size", [None, 8], ids=["unpaged", "paged"])
def test_long_prompts_prefilled_in_chunks_decode_the_argmax_of_the_full_sequence(devices, raw_params, page_size):
    engine = make_engine(devices, page_size=page_size, **CHUNKED)
    prompts = _prompts()
    out = Generator(engine, engine.load_params(raw_params)).rollouts(prompts, SamplingParams(temperature=0.0,
                                                                                            max_new_tokens=10))
    assert out.stats["prefill_chunks"] == 3 + 3 + sum(-(-p.size // 16) for p in prompts[:5] if p.size > 16)
    for r, logits in enumerate(teacher_forced_logits(raw_params, TINY, prompts, out)):
        np.testing.assert_array_equal(out.tokens[r, : out.lengths[r]], np.argmax(logits, -1))


def test_chunked_prefill_samples_the_tokens_of_a_whole_prompt_prefill(devices, raw_params):
    prompts = _prompts()
    whole = make_engine(devices, max_prefill_length=40, max_target_length=64)
    chunked = make_engine(devices, **CHUNKED)
    a, b = (Generator(e, e.load_params(raw_params)).rollouts(prompts, SAMPLED) for e in (whole, chunked))
    np.testing.assert_array_equal(b.tokens, a.tokens)
    np.testing.assert_array_equal(b.lengths, a.lengths)
    np.testing.assert_allclose(b.logprobs, a.logprobs, atol=2e-6, rtol=0)


def test_prompts_the_chunks_cannot_hold_are_refused(devices, raw_params):
    engine = make_engine(devices, **CHUNKED)
    gen = Generator(engine, engine.load_params(raw_params))
    with pytest.raises(EngineError, match="prompt 0 has 41 tokens; prompts need 1 to max_prompt_length=40"):
        gen.rollouts([np.arange(41)], SamplingParams(max_new_tokens=4))
    tight = make_engine(devices, max_prefill_length=16, max_prompt_length=39, max_target_length=40)
    with pytest.raises(EngineError, match="padded to 48 positions, more than max_target_length=40"):
        Generator(tight, tight.load_params(raw_params)).rollouts([np.arange(33)], SamplingParams(max_new_tokens=4))
    with pytest.raises(EngineError, match=r"max_prompt_length \(70\) must be in \[max_prefill_length, "):
        make_engine(devices, max_prompt_length=70)
