"""Conversations in the engine: a finished sequence's KV cache kept (``rollouts(keep=True)``) and extended by a
later prompt (``prefixes=``) generates what a prefill of the whole conversation generates: greedy tokens are the
argmax over the full sequence (reference: one uncached forward), sampled tokens equal the re-prefilling
engine's with log-probs to float rounding, over several turns, with tp 1 and 2; bad uses are refused."""

import numpy as np
import pytest
from _engine_testlib import TINY, make_engine, make_prompts, teacher_forced_logits

from nereus_jax.engine import EngineError, Generator, SamplingParams

ARGS = dict(max_prefill_length=63, max_target_length=64)
ENV = [np.array([11, 12, 13]), np.array([40, 41, 42, 43, 44, 45, 46]), np.array([7])]  # "tool answers"


def _turns(gen, prompts, sampling, kept_cache):
    """Three turns of every prompt (n = 1 after the first); per turn the rollouts and each row's sequence."""
    seqs = [list(p) for p in prompts]
    outs, kept = [], None
    for turn, env in enumerate(ENV):
        if turn == 0:
            out = gen.rollouts(prompts, sampling, keep=kept_cache)
        elif kept_cache:
            conts = [np.asarray(s[k[1]:], np.int32) for s, k in zip(seqs, kept, strict=True)]
            out = gen.rollouts(conts, sampling, keep=True, prefixes=kept, prompt_ids=np.arange(len(seqs)) + 100 * turn)
        else:
            out = gen.rollouts([np.asarray(s, np.int32) for s in seqs], sampling,
                               prompt_ids=np.arange(len(seqs)) + 100 * turn)
        kept = out.kept
        for r in range(out.num_rows):
            seqs[r] += out.tokens[r, :out.lengths[r]].tolist() + env.tolist()
        outs.append(out)
    return outs, seqs


@pytest.mark.parametrize("tp", [1, 2])
def test_greedy_turns_on_a_kept_cache_are_the_argmax_of_the_whole_conversation(devices, raw_params, tp):
    engine = make_engine(devices, tp=tp, **ARGS)
    prompts = make_prompts(4, seed=3, low=3, high=9)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=5, stop_tokens=(9,))
    gen = Generator(engine, engine.load_params(raw_params))
    outs, seqs = _turns(gen, prompts, greedy, kept_cache=True)
    assert outs[1].stats["prefill_onto"] == 4 and outs[2].stats["prefill_onto"] == 4
    for turn, out in enumerate(outs):  # reference: the full conversation up to this turn, one forward pass
        starts = [len(p) + sum(int(o.lengths[r]) + ENV[k].size for k, o in enumerate(outs[:turn]))
                  for r, p in enumerate(prompts)]
        history = [np.asarray(s[:n], np.int32) for s, n in zip(seqs, starts, strict=True)]
        for r, logits in enumerate(teacher_forced_logits(raw_params, TINY, history, out)):
            np.testing.assert_array_equal(out.tokens[r, :out.lengths[r]], np.argmax(logits, -1))
    _, again = _turns(Generator(engine, engine.load_params(raw_params)), prompts, greedy, kept_cache=False)
    assert again == seqs  # re-prefilling every turn: the same conversation, token for token


def test_sampled_turns_on_a_kept_cache_draw_what_re_prefilling_draws(devices, raw_params):
    engine = make_engine(devices, **ARGS)
    prompts = make_prompts(3, seed=8, low=4, high=10)
    sampled = SamplingParams(temperature=1.0, top_k=20, max_new_tokens=6, seed=2, stop_tokens=(9,))
    kept_outs, kept = _turns(Generator(engine, engine.load_params(raw_params)), prompts, sampled, True)
    full_outs, full = _turns(Generator(engine, engine.load_params(raw_params)), prompts, sampled, False)
    assert kept == full
    for a, b in zip(kept_outs, full_outs, strict=True):
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=2e-6, rtol=0)


def test_kept_caches_are_refused_where_they_cannot_work(devices, raw_params):
    paged = make_engine(devices, page_size=8, **ARGS)
    with pytest.raises(EngineError, match="contiguous KV cache"):
        Generator(paged, paged.load_params(raw_params)).rollouts(make_prompts(1), SamplingParams(), keep=True)
    engine = make_engine(devices, **ARGS)
    gen = Generator(engine, engine.load_params(raw_params))
    out = gen.rollouts(make_prompts(1, low=20, high=20), SamplingParams(temperature=0.0, max_new_tokens=4), keep=True)
    (kept,) = out.kept
    assert kept[1] == 20 + 4 - 1  # the prompt and every drawn token but the last
    with pytest.raises(EngineError, match="extends a cache"):
        gen.rollouts([np.arange(40) % 100], SamplingParams(max_new_tokens=4), prefixes=[kept])
    with pytest.raises(EngineError, match="one entry"):
        gen.rollouts([np.arange(3)], SamplingParams(n=2), prefixes=[kept])
