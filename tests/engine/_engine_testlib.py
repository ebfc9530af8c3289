"""Helpers of the engine tests: the tiny model, engines on a tp mesh, prompts, the full-forward reference."""

import jax.numpy as jnp
import numpy as np

from nereus_jax.config import ModelConfig
from nereus_jax.engine import JaxEngine
from nereus_jax.models import forward
from nereus_jax.sharding import Layout, make_mesh

TINY = ModelConfig()  # vocab 128, 2 layers, 4 heads, 2 kv heads: tp=4 exceeds the kv heads
ENGINE_ARGS = dict(max_concurrent_decodes=4, max_prefill_length=32, max_target_length=64, max_prefill_batch=4)


def make_engine(devices, tp=1, cfg=TINY, ep=1, **overrides):
    return JaxEngine(cfg, make_mesh(devices[:tp * ep], Layout(tp=tp, ep=ep)), **{**ENGINE_ARGS, **overrides})


def make_prompts(count, seed=0, low=3, high=20, vocab=TINY.vocab_size):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, int(rng.integers(low, high + 1))).astype(np.int32) for _ in range(count)]


def teacher_forced_logits(params, cfg, prompts, out):
    """Full uncached forward over each row's prompt + generated tokens; returns, per row, the logits
    [length, vocab] of the positions that predicted its generated tokens (causal, so later tokens and the
    right padding cannot affect them: this is the argmax-over-the-growing-sequence reference)."""
    rows = range(out.num_rows)
    seqs = [np.concatenate([prompts[out.prompt_index[r]], out.tokens[r, : out.lengths[r]]]) for r in rows]
    width = max(s.size for s in seqs)
    batch = np.stack([np.pad(s, (0, width - s.size)) for s in seqs])
    logits = np.asarray(forward(params, cfg, jnp.asarray(batch)))
    res = []
    for r, s in enumerate(seqs):
        p = prompts[out.prompt_index[r]].size
        res.append(logits[r, p - 1 : s.size - 1])
    return res


def assert_same_generation(a, b):
    """Two generations agree bit for bit: lengths, tokens, log-probabilities, policy versions, finish reasons."""
    np.testing.assert_array_equal(a.lengths, b.lengths)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.logprobs, b.logprobs)  # bit-identical, not close
    np.testing.assert_array_equal(a.param_versions, b.param_versions)
    assert a.finish_reasons == b.finish_reasons
