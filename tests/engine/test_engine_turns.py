"""Conversations in the engine (``Conversations``): turns generated while other turns wait for their answers,
a parked conversation's next turn prefilled onto the cache it left in its slot (``prefill_slots``), evicted ones
put back from host memory or prefilled whole. References: greedy turns are the argmax over the whole
conversation (one uncached forward), and every turn draws what a fresh ``Generator.rollouts`` of the whole
conversation draws (the re-prefill path), tokens bit for bit, log-probs to float rounding; over several turns,
tp 1 and 2, with evictions, on a paged engine (re-prefill), while one conversation's answer is held back
until every other one is over, and with tools of different latencies answering from other threads (turns
interleaved out of lock-step)."""

import dataclasses
import threading

import jax.numpy as jnp
import numpy as np
import pytest
from _engine_testlib import TINY, make_engine, make_prompts

from nereus_jax.engine import Conversations, EngineError, Generator, SamplingParams
from nereus_jax.models import forward

ARGS = dict(max_prefill_length=63, max_target_length=64)
ENV = [np.array([11, 12, 13]), np.array([40, 41, 42, 43, 44, 45, 46]), np.array([7])]  # "tool answers"
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=5, stop_tokens=(9,))
SAMPLED = SamplingParams(temperature=1.0, top_k=20, max_new_tokens=6, seed=2, stop_tokens=(9,), n=2)


def _turn_id(conversation: int, turn: int) -> int:
    return 100 * turn + conversation


def _converse(gen, prompts, sampling, park, hold=None, defer=False, max_saved_bytes=None, latency=None, env=ENV):
    """Every conversation answered with ENV's tokens after each turn, then closed; ``hold``: a conversation
    whose first answer waits until every other conversation is closed; ``defer``: each answer waits until
    the next turn of another conversation ends (while one is decoding), so conversations sit parked while
    others want slots; ``latency(c, k)``: seconds the "tool" answering turn k (1-based) of conversation c takes,
    the answer given from a timer thread as a tool pool gives it. Returns the turns, the conversations' tokens,
    the order turns ended in, and the run's statistics."""
    convs = Conversations(gen, prompts, sampling, park=park, max_saved_bytes=max_saved_bytes)
    n = sampling.n
    seqs = [list(map(int, prompts[c // n])) for c in range(convs.count)]
    turns, order, closed, pending = [[] for _ in seqs], [], set(), []
    busy = set(range(len(seqs)))  # conversations the engine has (not waiting for an answer)

    def answer(c):
        k = len(turns[c])
        if k > len(env):
            convs.close(c)
            closed.add(c)
            if hold is not None and hold not in closed and len(closed) == len(seqs) - 1:
                answer(hold)  # every other conversation is over: the held one goes on
            return
        seqs[c] += env[k - 1].tolist()
        busy.add(c)
        convs.answer(c, env[k - 1], limit=sampling.max_new_tokens, prompt_id=_turn_id(c, k))

    def on_turn(turn):
        c = turn.conversation
        busy.discard(c)
        turns[c].append(turn)
        order.append(c)
        seqs[c] += turn.tokens.tolist()
        if c == hold and len(turns[c]) == 1:
            return
        if latency is not None:
            timer = threading.Timer(latency(c, len(turns[c])), answer, args=(c,))
            timer.daemon = True
            timer.start()
            return
        if not defer:
            answer(c)
            return
        for d in pending:
            answer(d)
        pending[:] = [c] if busy else []
        if not busy:  # nothing else would end a turn: answer now
            answer(c)

    watchdog = threading.Timer(600, lambda: convs.fail(TimeoutError("a held conversation stalled the others")))
    watchdog.start()
    try:
        stats = convs.run(on_turn)
    finally:
        watchdog.cancel()
    return turns, seqs, order, stats


def _reprefilled(gen, prompts, sampling):
    """The reference: every turn a fresh ``rollouts`` call on the whole conversation so far."""
    n = sampling.n
    first = gen.rollouts(prompts, sampling)
    seqs = [list(map(int, prompts[c // n])) for c in range(first.num_rows)]
    turns = [[(first.tokens[c, :first.lengths[c]], first.logprobs[c, :first.lengths[c]])] for c in range(len(seqs))]
    one = dataclasses.replace(sampling, n=1)
    for k, env in enumerate(ENV, start=1):
        for c in range(len(seqs)):
            seqs[c] += turns[c][-1][0].tolist() + env.tolist()
        out = gen.rollouts([np.asarray(s, np.int32) for s in seqs], one,
                           prompt_ids=[_turn_id(c, k) for c in range(len(seqs))])
        for c in range(len(seqs)):
            turns[c].append((out.tokens[c, :out.lengths[c]], out.logprobs[c, :out.lengths[c]]))
    for c in range(len(seqs)):
        seqs[c] += turns[c][-1][0].tolist()
    return turns, seqs


def _assert_same_turns(turns, reference, atol):
    for got, want in zip(turns, reference, strict=True):
        assert len(got) == len(want) == len(ENV) + 1
        for turn, (tokens, logprobs) in zip(got, want, strict=True):
            np.testing.assert_array_equal(turn.tokens, tokens)
            np.testing.assert_allclose(turn.logprobs, logprobs, atol=atol, rtol=0)


def _assert_greedy(raw_params, prompts, turns, seqs, n=1, env=ENV):
    """Each turn's tokens are the argmax after everything before them (one forward over each conversation)."""
    width = max(len(s) for s in seqs)
    logits = np.asarray(forward(raw_params, TINY, jnp.asarray([s + [0] * (width - len(s)) for s in seqs])))
    for c, conv in enumerate(turns):
        at = len(prompts[c // n])
        for k, turn in enumerate(conv):
            m = turn.tokens.size
            np.testing.assert_array_equal(turn.tokens, np.argmax(logits[c, at - 1:at - 1 + m], -1))
            at += m + (env[k].size if k < len(env) else 0)


@pytest.mark.parametrize("tp", [1, 2])
def test_greedy_turns_on_parked_caches_are_the_argmax_of_the_whole_conversation(devices, raw_params, tp):
    engine = make_engine(devices, tp=tp, **ARGS)
    prompts = make_prompts(4, seed=3, low=3, high=9)
    gen = Generator(engine, engine.load_params(raw_params))
    turns, seqs, _, stats = _converse(gen, prompts, GREEDY, park=True)
    assert stats["continued"] == 4 * len(ENV) and stats["evicted"] == 0  # every later turn onto its slot
    _assert_greedy(raw_params, prompts, turns, seqs)
    reference, ref_seqs = _reprefilled(gen, prompts, GREEDY)
    assert seqs == ref_seqs
    _assert_same_turns(turns, reference, atol=1e-5)
    again, again_seqs, _, stats = _converse(gen, prompts, GREEDY, park=False)
    assert stats["continued"] == 0 and again_seqs == seqs
    # re-prefilled, but a few rows a call (the reference prefills full batches): float rounding of the first
    # token's log-prob, 1 ulp seen
    _assert_same_turns(again, reference, atol=1e-5)


def test_sampled_turns_on_parked_caches_draw_what_re_prefilling_draws(devices, raw_params):
    engine = make_engine(devices, **ARGS)
    prompts = make_prompts(3, seed=8, low=4, high=10)
    gen = Generator(engine, engine.load_params(raw_params))
    turns, seqs, _, stats = _converse(gen, prompts, SAMPLED, park=True)
    assert stats["continued"] == 6 * len(ENV)
    reference, ref_seqs = _reprefilled(gen, prompts, SAMPLED)
    assert seqs == ref_seqs
    _assert_same_turns(turns, reference, atol=2e-6)


@pytest.mark.parametrize("max_saved_bytes", [None, 0])  # evicted caches put back from host memory / re-prefilled
def test_evicted_conversations_resume_with_the_same_tokens(devices, raw_params, max_saved_bytes):
    engine = make_engine(devices, max_concurrent_decodes=2, **ARGS)  # 5 conversations, 2 slots
    prompts = make_prompts(5, seed=5, low=3, high=9)
    gen = Generator(engine, engine.load_params(raw_params))
    turns, seqs, _, stats = _converse(gen, prompts, GREEDY, park=True, defer=True, max_saved_bytes=max_saved_bytes)
    assert stats["evicted"] > 0 and stats["continued"] > 0  # both kinds of later turn happened
    if max_saved_bytes is None:
        assert stats["saved"] > 0 and stats["restored"] > 0
    else:
        assert stats["saved"] == stats["restored"] == 0
    reference, ref_seqs = _reprefilled(gen, prompts, GREEDY)
    assert seqs == ref_seqs
    _assert_same_turns(turns, reference, atol=1e-5)


def test_a_paged_engine_re_prefills_every_turn_with_the_same_tokens(devices, raw_params):
    engine = make_engine(devices, page_size=8, kv_pages=12, **ARGS)  # room for about 3 of 4 conversations
    prompts = make_prompts(4, seed=3, low=3, high=9)
    gen = Generator(engine, engine.load_params(raw_params))
    turns, seqs, _, stats = _converse(gen, prompts, GREEDY, park=False)
    assert stats["continued"] == 0
    _assert_greedy(raw_params, prompts, turns, seqs)
    contiguous = make_engine(devices, **ARGS)
    reference, ref_seqs = _reprefilled(Generator(contiguous, contiguous.load_params(raw_params)), prompts, GREEDY)
    assert seqs == ref_seqs
    _assert_same_turns(turns, reference, atol=1e-5)


def test_other_conversations_decode_while_one_waits_for_its_answer(devices, raw_params):
    engine = make_engine(devices, **ARGS)
    prompts = make_prompts(4, seed=3, low=3, high=9)
    gen = Generator(engine, engine.load_params(raw_params))
    turns, seqs, order, _ = _converse(gen, prompts, GREEDY, park=True, hold=0)
    # conversation 0 ended its first turn, then every other conversation ran all its turns, then 0 went on
    assert order[-len(ENV):] == [0] * len(ENV)
    assert sorted(order[:-len(ENV)]) == [0] + [c for c in (1, 2, 3) for _ in range(len(ENV) + 1)]
    reference, ref_seqs = _reprefilled(gen, prompts, GREEDY)
    assert seqs == ref_seqs  # the schedule changes no token
    _assert_same_turns(turns, reference, atol=1e-5)


def test_tools_of_different_latencies_interleave_turns_with_the_same_tokens(devices, raw_params):
    """Each conversation's tool answers after its own latency (conversations 0 and 1 slow, the others fast and
    varied by turn), from timer threads: the fast conversations run all their turns while the slow ones wait
    (turns end out of lock-step), 6 conversations share 3 slots (parked ones evicted, copied out and put back),
    and every turn draws what re-prefilling the whole conversation draws."""
    engine = make_engine(devices, max_concurrent_decodes=3, **ARGS)
    prompts = make_prompts(3, seed=6, low=3, high=9)  # x n=2 samples: 6 conversations
    gen = Generator(engine, engine.load_params(raw_params))
    reference, ref_seqs = _reprefilled(gen, prompts, SAMPLED)
    _converse(gen, prompts, SAMPLED, park=True, defer=True)  # compiles the turns' programs before the timing
    slow = 0.5

    def latency(c, k):
        return slow if c < 2 else float(np.random.default_rng([c, k]).uniform(0.0, 0.02))

    turns, seqs, order, stats = _converse(gen, prompts, SAMPLED, park=True, latency=latency)
    assert seqs == ref_seqs  # the schedule changes no token
    _assert_same_turns(turns, reference, atol=1e-5)
    assert stats["evicted"] > 0 and stats["continued"] > 0
    # out of lock-step: a fast conversation ran all its turns before slow conversation 0 ended its third
    third_of_0 = [i for i, c in enumerate(order) if c == 0][2]
    assert any(order[:third_of_0].count(c) == len(ENV) + 1 for c in range(2, len(seqs))), order


def test_turns_of_any_length_run_a_bounded_set_of_prefill_programs_that_the_warm_up_compiles(devices, raw_params,
                                                                                           monkeypatch):
    """Answers of 2 to 24 tokens onto parked caches, one to four conversations a call, with ``turn_chunk=16`` (the
    longest answer goes in two chunks): every call runs one of ``turn_shapes`` (3 programs: 1, 2 or 4 rows x
    16 tokens), whatever the lengths; ``warm_turns`` compiles the ones the run did not meet, and a second run
    compiles nothing. Each turn is the argmax after the whole conversation (one uncached forward)."""
    env = [np.arange(20, 43), np.array([5]), np.arange(60, 69)]  # + the last drawn token: 24, 2 and 10 tokens
    engine = make_engine(devices, turn_chunk=16, **ARGS)
    prompts = make_prompts(4, seed=3, low=3, high=9)
    gen = Generator(engine, engine.load_params(raw_params))
    assert engine.turn_shapes() == [(1, 16), (2, 16), (4, 16)] and engine.turn_shapes(max_rows=2)[-1] == (2, 16)
    default = make_engine(devices, **ARGS)  # turn_chunk = max_prefill_length = 63: chunks of 16, 32 or 63 tokens
    assert default.turn_shapes(max_rows=1, max_tokens=20) == [(1, 16), (1, 32)] and len(default.turn_shapes()) == 9
    program, runs = engine._programs.prefill_slots, []
    monkeypatch.setattr(engine._programs, "prefill_slots", lambda *a: runs.append(a[3].shape) or program(*a))
    turns, seqs, _, stats = _converse(gen, prompts, GREEDY, park=True, env=env)
    assert stats["continued"] == 4 * len(env)
    assert len(runs) > stats["prefill_slots_calls"] and set(runs) <= set(engine.turn_shapes())  # 24 tokens: 2 runs
    assert 0 < engine.traces["prefill_slots"] <= len(engine.turn_shapes())
    _assert_greedy(raw_params, prompts, turns, seqs, env=env)
    gen.warm_turns()
    assert engine.traces["prefill_slots"] == len(engine.turn_shapes())
    again, again_seqs, _, _ = _converse(gen, prompts, GREEDY, park=True, env=env)
    assert engine.traces["prefill_slots"] == len(engine.turn_shapes()) and again_seqs == seqs


def test_conversations_refuse_what_cannot_work(devices, raw_params):
    with pytest.raises(EngineError, match="turn_chunk"):
        make_engine(devices, turn_chunk=64, **ARGS)  # a chunk longer than max_prefill_length
    paged = make_engine(devices, page_size=8, **ARGS)
    with pytest.raises(EngineError, match="contiguous KV cache"):
        Conversations(Generator(paged, paged.load_params(raw_params)), make_prompts(1), GREEDY, park=True)
    engine = make_engine(devices, **ARGS)
    gen = Generator(engine, engine.load_params(raw_params))
    convs = Conversations(gen, make_prompts(1), GREEDY)
    with pytest.raises(EngineError, match="limit must be in"):
        convs.run(lambda turn: convs.answer(turn.conversation, [1], limit=6, prompt_id=1))
    convs = Conversations(gen, make_prompts(1), GREEDY)
    with pytest.raises(ValueError, match="no answer"):
        convs.run(lambda turn: convs.fail(ValueError("no answer")))
    convs = Conversations(gen, make_prompts(1, low=40, high=40), GREEDY)  # 40 + 5 + 30 + 5 > 64
    with pytest.raises(EngineError, match="exceed max_target_length"):
        convs.run(lambda turn: convs.answer(turn.conversation, [1] * 30, limit=5, prompt_id=1))
    out = gen.rollouts(make_prompts(2), GREEDY)  # a failed run leaves the generator usable
    assert out.num_rows == 2
