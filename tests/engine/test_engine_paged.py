"""Paged KV memory (``JaxEngine(page_size=...)``): the same tokens as the unpaged engine, bit-identical
whatever the pool size, capacity, admission policy, preemptions, decode steps per call or schedule; pages
return to the pool; a request that cannot fit is refused; a slot without a page waits and never corrupts
another; the paged decode path equals the full forward per model family."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _engine_testlib import TINY, make_engine, make_prompts, teacher_forced_logits
from _engine_testlib import assert_same_generation as _assert_same

from nereus_jax.engine import EngineError, Generator, SamplingParams, decode, make_requests, paged
from nereus_jax.models import forward, init_params

PAGE = 8
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12)
SAMPLED = SamplingParams(temperature=1.0, top_k=20, top_p=0.95, max_new_tokens=12, n=3, seed=11)


@pytest.fixture(scope="module")
def paged_engine(devices, raw_params):
    engine = make_engine(devices, page_size=PAGE)
    return engine, engine.load_params(raw_params)


@pytest.fixture(scope="module")
def tight_engine(devices, raw_params):
    """5 pages of 8 positions: room for two or three of the tests' sequences at a time, not four."""
    engine = make_engine(devices, page_size=PAGE, kv_pages=5)
    return engine, engine.load_params(raw_params)


def _with_stop(gen, prompts, sampling):
    """``sampling`` with a stop token some rows draw mid-response (so rows end at different steps)."""
    stop = int(gen.rollouts(prompts, sampling).tokens[0, 3])
    return dataclasses.replace(sampling, stop_tokens=(stop,))


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_paged_engine_draws_the_unpaged_engines_tokens(gen, paged_engine, sampling):
    prompts = make_prompts(7, seed=21)
    sampling = _with_stop(gen, prompts, sampling)
    unpaged = gen.rollouts(prompts, sampling)
    out = Generator(*paged_engine).rollouts(prompts, sampling)
    assert "stop" in unpaged.finish_reasons and "length" in unpaged.finish_reasons
    np.testing.assert_array_equal(out.tokens, unpaged.tokens)
    np.testing.assert_array_equal(out.lengths, unpaged.lengths)
    assert out.finish_reasons == unpaged.finish_reasons
    # the unpaged attention sums over all max_target_length positions, the paged one over the live pages:
    # XLA rounds the two differently, by a few float32 ulps
    np.testing.assert_allclose(out.logprobs, unpaged.logprobs, atol=2e-6, rtol=0)


@pytest.mark.parametrize("admission", ["preempt", "reserve"])
def test_a_small_pool_admission_and_preemption_never_change_tokens_or_logprobs(paged_engine, tight_engine,
                                                                                admission):
    prompts = make_prompts(6, seed=31)
    sampling = dataclasses.replace(SAMPLED, max_new_tokens=16)
    whole = Generator(*paged_engine).rollouts(prompts, sampling)
    gen = Generator(*tight_engine, admission=admission)
    out = gen.rollouts(prompts, sampling)
    _assert_same(out, whole)
    assert out.stats["peak_pages"] <= 5 and whole.stats["peak_live"] == 4
    if admission == "preempt":
        assert out.stats["preemptions"] > 0 and out.stats["peak_live"] >= 2
    else:
        assert out.stats.get("preemptions", 0) == 0
    assert tight_engine[0].free_pages(gen._state) == 5


def test_capacity_decode_steps_per_call_and_schedule_never_change_tokens(devices, raw_params, paged_engine):
    prompts = make_prompts(9, seed=22)
    lengths = [1, 2, 9, 4, 12, 5, 3, 7, 6]
    ref = Generator(*paged_engine).rollouts(prompts, SAMPLED, forced_lengths=lengths)
    other = make_engine(devices, page_size=PAGE, max_target_length=128, decode_steps_per_call=4,
                        max_concurrent_decodes=3)
    _assert_same(Generator(other, other.load_params(raw_params)).rollouts(prompts, SAMPLED, forced_lengths=lengths),
                 ref)
    static = Generator(*paged_engine).rollouts(prompts, SAMPLED, forced_lengths=lengths, refill="static")
    _assert_same(static, ref)


def test_param_swap_mid_generation_lands_as_on_the_unpaged_engine(gen, engine, paged_engine):
    other_raw = init_params(TINY, seed=1)
    prompts = make_prompts(8, seed=7)
    outs = []
    for g in (gen, Generator(*paged_engine)):
        other = g.engine.load_params(other_raw)
        swap = lambda g, step, other=other: g.set_params(other, version=7) if step == 5 else None  # noqa: E731
        outs.append(g.rollouts(prompts, GREEDY, on_step=swap))
    unpaged, out = outs
    np.testing.assert_array_equal(out.param_versions, unpaged.param_versions)
    np.testing.assert_array_equal(out.tokens, unpaged.tokens)
    assert set(np.unique(out.param_versions)) == {0, 7}


def test_tp2_paged_engine_matches_the_unpaged_engine_and_its_own_small_pool(devices, raw_params):
    prompts = make_prompts(6, seed=24)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=14, n=2, seed=4, stop_tokens=(7, 19))
    unpaged, full, tight = (make_engine(devices, tp=2, **kw) for kw in
                            ({}, {"page_size": PAGE}, {"page_size": PAGE, "kv_pages": 5}))
    gens = [Generator(e, e.load_params(raw_params)) for e in (unpaged, full, tight)]
    outs = [g.rollouts(prompts, sampling) for g in gens]
    np.testing.assert_array_equal(outs[1].tokens, outs[0].tokens)
    np.testing.assert_allclose(outs[1].logprobs, outs[0].logprobs, atol=2e-6, rtol=0)
    _assert_same(outs[2], outs[1])
    assert outs[2].stats["preemptions"] > 0
    assert gens[2]._state.caches[0][0].sharding.spec[1] == "tp"  # pools split over kv heads


def test_pages_return_to_the_pool_after_1000_random_requests(devices, raw_params):
    engine = make_engine(devices, page_size=PAGE, kv_pages=12, max_concurrent_decodes=8)
    gen = Generator(engine, engine.load_params(raw_params))
    rng = np.random.default_rng(0)
    checks = []

    def check(g, step):
        if step % 7 == 0:
            checks.append(_page_invariants(engine, g._state))

    served = 0
    while served < 1000:
        count, n = int(rng.integers(20, 60)), int(rng.integers(1, 4))
        prompts = make_prompts(count, seed=int(rng.integers(1 << 30)), low=1, high=20)
        sampling = SamplingParams(temperature=1.0, max_new_tokens=int(rng.integers(1, 24)), n=n,
                                  seed=int(rng.integers(100)), stop_tokens=tuple(rng.integers(0, 128, 2).tolist()))
        forced = rng.integers(1, sampling.max_new_tokens + 1, count) if rng.random() < 0.3 else None
        out = gen.rollouts(prompts, sampling, forced_lengths=forced, on_step=check)
        assert np.all(out.lengths >= 1) and out.num_rows == count * n
        assert engine.free_pages(gen._state) == 12  # every page is back
        served += count * n
    assert len(checks) > 50 and all(checks)


def _page_invariants(engine, state) -> bool:
    """Every page is either free or held by exactly one live slot, which holds ceil(length / page) pages."""
    table, held, free, count, lengths, active = jax.device_get((*state.pages, state.lengths, state.active))
    want = np.where(active, -(-lengths // engine.page_size), 0)
    pages = np.concatenate([free[:count]] + [table[s, :held[s]] for s in range(table.shape[0])])
    return bool(np.array_equal(held, want) and np.array_equal(np.sort(pages), np.arange(engine.kv_pages)))


def test_a_request_the_pool_cannot_hold_is_refused_before_anything_runs(tight_engine):
    gen = Generator(*tight_engine)
    with pytest.raises(EngineError, match=r"needs 6 KV pages; the engine's pool has kv_pages=5"):
        gen.rollouts([np.arange(1, 20), [1, 2]], SamplingParams(max_new_tokens=24))
    assert gen.rollouts([[1, 2]], SamplingParams(max_new_tokens=24)).lengths[0] == 24  # 25 positions fit
    with pytest.raises(EngineError, match="admission must be one of"):
        Generator(*tight_engine, admission="optimistic")


def _insert(engine, params, state, slot, prompt, limit=30, seed=0):
    req = make_requests(1, engine.max_stop_tokens, prompt=seed, temperature=1.0, limit=limit)
    prefix, _ = engine.prefill(params=params, padded_tokens=np.asarray(prompt), true_length=len(prompt),
                               requests=req)
    return engine.insert(prefix, state, slot)


def test_a_slot_without_a_free_page_waits_and_never_corrupts_another(devices, raw_params):
    engine = make_engine(devices, page_size=PAGE, kv_pages=3)
    params = engine.load_params(raw_params)
    a, b = np.arange(1, 9), np.arange(20, 33)  # 8 tokens: 1 full page; 13 tokens: 2 pages, 3 positions free
    crowded = _insert(engine, params, engine.init_decode_state(), 0, a)
    crowded = _insert(engine, params, crowded, 1, b, seed=1)  # the pool is full
    crowded = _insert(engine, params, crowded, 2, np.arange(40, 44), seed=2)  # no room: slot 2 stays empty
    assert np.asarray(crowded.active).tolist() == [True, True, False, False] and engine.free_pages(crowded) == 0
    alone_b = _insert(engine, params, engine.init_decode_state(), 1, b, seed=1)
    for _ in range(3):  # slot 0's next position starts a page: it waits; slot 1 fills its last page
        crowded, c = engine.generate(params, crowded)
        alone_b, r = engine.generate(params, alone_b)
        assert np.asarray(c.valid).tolist() == [False, True, False, False]
        assert (np.asarray(c.tokens)[1], np.asarray(c.logprobs)[1]) == (np.asarray(r.tokens)[1],
                                                                        np.asarray(r.logprobs)[1])
    assert (int(crowded.lengths[0]), int(crowded.steps[0]), bool(crowded.active[0])) == (8, 1, True)
    crowded, _ = engine.evict(crowded, 1)  # slot 1 leaves: slot 0 gets pages and goes on as if alone
    alone_a = _insert(engine, params, engine.init_decode_state(), 0, a)
    for _ in range(3):
        crowded, c = engine.generate(params, crowded)
        alone_a, r = engine.generate(params, alone_a)
        assert np.asarray(c.valid).tolist() == [True, False, False, False]
        assert (np.asarray(c.tokens)[0], np.asarray(c.logprobs)[0]) == (np.asarray(r.tokens)[0],
                                                                        np.asarray(r.logprobs)[0])
    assert _page_invariants(engine, crowded)


def test_evict_and_resume_into_another_slot_continue_bit_for_bit(paged_engine):
    engine, params = paged_engine
    ref = _insert(engine, params, engine.init_decode_state(), 0, np.arange(3, 17), seed=5)
    state = _insert(engine, params, engine.init_decode_state(), 0, np.arange(3, 17), seed=5)
    state = _insert(engine, params, state, 1, np.arange(30, 35), seed=6)
    want = []
    for _ in range(9):
        ref, r = engine.generate(params, ref)
        want.append((np.asarray(r.tokens)[0], np.asarray(r.logprobs)[0]))
    got = []
    for step in range(9):
        if step == 3:
            state, parked = engine.evict(state, 0, pages=5)
            parked = jax.device_get(parked)  # through host memory
            for _ in range(2):  # slot 1 goes on meanwhile
                state, _ = engine.generate(params, state)
            state = engine.resume(parked, state, 3)
        state, r = engine.generate(params, state)
        slot = 0 if step < 3 else 3
        got.append((np.asarray(r.tokens)[slot], np.asarray(r.logprobs)[slot]))
    np.testing.assert_array_equal(np.array(got), np.array(want))
    assert _page_invariants(engine, state) and np.asarray(state.active).tolist() == [False, True, False, True]


def test_a_steady_workload_compiles_a_bounded_set_of_programs(devices, raw_params):
    engine = make_engine(devices, page_size=PAGE)
    gen = Generator(engine, engine.load_params(raw_params))
    sampling = SamplingParams(temperature=1.0, max_new_tokens=30, n=2)
    gen.rollouts(make_prompts(8, seed=0, low=1, high=32), sampling)
    compiled = dict(engine.traces)
    assert compiled["generate"] <= len(engine.item_buckets)
    for seed in range(1, 3):
        gen.rollouts(make_prompts(8, seed=seed, low=1, high=32), dataclasses.replace(sampling, seed=seed))
    assert dict(engine.traces)["generate"] <= len(engine.item_buckets)
    assert engine.traces["prefill"] == compiled["prefill"] and engine.traces["insert_many"] == compiled["insert_many"]


@pytest.mark.parametrize("kwargs,message", [
    ({"page_size": 0}, "page_size must be >= 1"),
    ({"kv_pages": 8}, "give page_size too"),
    ({"page_size": 4, "kv_pages": 8, "kv_bytes": 1 << 20}, "not both"),
    ({"page_size": 4, "kv_bytes": 10}, "kv_pages must be >= 1"),
])
def test_bad_paging_keywords_raise_a_clear_error(devices, kwargs, message):
    with pytest.raises(EngineError, match=message):
        make_engine(devices, **kwargs)


def test_kv_bytes_sizes_the_pool_and_the_default_pool_holds_every_slots_capacity(devices, engine, paged_engine):
    engine, unpaged = paged_engine[0], engine
    assert engine.kv_pages == 4 * 8 and engine.kv_cache_bytes == unpaged.kv_cache_bytes
    budget = make_engine(devices, page_size=PAGE, kv_bytes=engine.kv_page_bytes * 21 + 5)
    assert budget.kv_pages == 21 and budget.kv_cache_bytes == 21 * engine.kv_page_bytes
    # one page: 2 (k, v) x 2 layers x 2 kv heads x 8 positions x 16 head_dim x 4 bytes
    assert engine.kv_page_bytes == 2 * 2 * 2 * 8 * 16 * 4


def test_ragged_attention_ignores_padding_and_other_slots_and_equals_dense_attention():
    rng = np.random.default_rng(0)
    slots, k, g, e, size = 5, 2, 3, 8, 4
    q = jnp.asarray(rng.standard_normal((slots, k * g, e)), jnp.float32)
    k_pool, v_pool = (jnp.asarray(rng.standard_normal((40, k, size, e)), jnp.float32) for _ in range(2))
    table = paged.PageTable(jnp.asarray(rng.permutation(40)[:slots * 8].reshape(slots, 8).astype(np.int32)),
                            jnp.full((slots,), 8, jnp.int32), jnp.zeros((40,), jnp.int32), jnp.int32(0))
    positions = jnp.asarray([0, 5, 13, 31, 9], jnp.int32)
    attending = jnp.asarray([True, True, True, True, False])

    def ragged(positions, attending, count):
        items = paged.work_items(table, positions, attending, count, size)
        return np.asarray(jax.jit(paged.attend)(q, k_pool, v_pool, items))

    out = ragged(positions, attending, 17)
    for count in (20, 64):
        np.testing.assert_array_equal(ragged(positions, attending, count), out)
    other = ragged(positions.at[3].set(2).at[0].set(7), attending, 17)
    np.testing.assert_array_equal(other[[1, 2]], out[[1, 2]])
    assert np.all(out[4] == 0)
    for s in range(4):  # dense attention over the slot's positions gathered in order
        keys = k_pool[table.table[s]].transpose(1, 0, 2, 3).reshape(k, -1, e)[None]
        values = v_pool[table.table[s]].transpose(1, 0, 2, 3).reshape(k, -1, e)[None]
        mask = (jnp.arange(keys.shape[2]) <= positions[s])[None, None, :]
        dense = decode._attend_one(q[s][None, None], keys, values, mask)[0, 0]
        np.testing.assert_allclose(out[s], np.asarray(dense), atol=1e-6, rtol=0)


@pytest.mark.parametrize("family", ["llama", "qkv_bias", "qwen3"])
def test_paged_decode_path_equals_forward_for_each_step(family):
    cfg = {"llama": TINY, "qkv_bias": dataclasses.replace(TINY, qkv_bias=True),
           "qwen3": dataclasses.replace(TINY, name="qwen3-tiny", family="qwen3", qk_norm=True, head_dim=32,
                                        tie_embeddings=True)}[family]
    raw = init_params(cfg, seed=2)
    if family == "qwen3":  # non-trivial norm scales, so a skipped q/k norm would show
        raw["layers"]["attn"] = {k: ({"scale": v["scale"] + 0.3 * jax.random.normal(jax.random.key(3),
                                                                                    v["scale"].shape)}
                                     if k.endswith("_norm") else v) for k, v in raw["layers"]["attn"].items()}
    if cfg.qkv_bias:
        raw["layers"]["attn"] = {k: v + 0.1 if k.startswith("b") else v for k, v in raw["layers"]["attn"].items()}
    params = decode.unstack_layers(raw)
    tokens = jax.random.randint(jax.random.key(9), (2, 11), 0, cfg.vocab_size)
    full = np.asarray(forward(raw, cfg, tokens))
    pages = paged.PageTable(jnp.asarray([[5, 1, 6], [0, 3, 2]], jnp.int32), jnp.full((2,), 3, jnp.int32),
                            jnp.zeros((8,), jnp.int32), jnp.int32(0))
    shape = (8, cfg.num_kv_heads, PAGE, cfg.head_dim)
    pools = tuple((jnp.zeros(shape), jnp.zeros(shape)) for _ in range(cfg.num_layers))
    step = jax.jit(decode.run_paged, static_argnums=1)
    for t in range(11):
        position = jnp.full((2,), t, jnp.int32)
        items = paged.work_items(pages, position, jnp.ones((2,), bool), 6, PAGE)
        write = pages.table[jnp.arange(2), position // PAGE]
        hidden, pools = step(params, cfg, tokens[:, t], position, pools, write, items)
        np.testing.assert_allclose(np.asarray(decode.logits(params, hidden[:, 0])), full[:, t], atol=1e-5, rtol=0)


def test_paged_greedy_tokens_are_the_argmax_over_the_growing_sequence(paged_engine, raw_params):
    prompts = make_prompts(6, seed=2)
    out = Generator(*paged_engine).rollouts(prompts, GREEDY)
    for r, logits in enumerate(teacher_forced_logits(raw_params, TINY, prompts, out)):
        np.testing.assert_array_equal(out.tokens[r, : out.lengths[r]], np.argmax(logits, -1))


def test_a_generate_call_stopped_mid_way_leaves_the_generator_usable(tight_engine):
    gen = Generator(*tight_engine)
    prompts = make_prompts(5, seed=41)

    def stop(g, step):
        assert g.progress()["decode_steps"] == step and g.progress()["live"] >= 1
        if step == 4:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        gen.rollouts(prompts, SAMPLED, on_step=stop)
    out = gen.rollouts(prompts, SAMPLED)  # starts from an empty state: every page free again
    _assert_same(out, Generator(*tight_engine).rollouts(prompts, SAMPLED))
    progress = gen.progress()
    assert progress["tokens"] == out.stats["tokens"] and progress["live"] == 0
    assert progress["slot_steps"] == out.stats["slot_steps"] and tight_engine[0].free_pages(gen._state) == 5
