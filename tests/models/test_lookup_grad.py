"""The embedding lookup's gradient (models/decoder.py ``_lookup``) against JAX's own transpose of the gather.

References: ``jnp.take(..., mode="clip")`` differentiated by autodiff (bit for bit on one device), the
gradient of a tied-embedding model with Qwen3's 151,936-token vocabulary on a dp 8 mesh through autodiff's gather
(the stage forward instead gathers the lookup's cotangents over dp: equal within 1e-6, and as close to one
device's), and that program's compiled memory: the gathered lookup's holds at least one vocabulary-sized
buffer less."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from nereus_jax.config import ModelConfig
from nereus_jax.models import forward, init_params
from nereus_jax.models.decoder import embed_tokens
from nereus_jax.models.vocab import head_logprobs
from nereus_jax.sharding import Layout, make_mesh
from nereus_jax.sharding.pipeline import pipeline_forward_fn

QWEN3_VOCAB = 151_936
CFG = ModelConfig(vocab_size=QWEN3_VOCAB, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                  num_kv_heads=1, head_dim=8, tie_embeddings=True)


def test_the_lookup_gradient_is_autodiffs_gather_transpose_bit_for_bit():
    table = jax.random.normal(jax.random.key(0), (50, 8))
    ids = jnp.array([[0, 3, 3, 49], [7, 3, 60, -2]])  # repeats, and ids past either end (clipped)
    g = jax.random.normal(jax.random.key(1), (2, 4, 8))

    def ours(t):
        return jnp.sum(embed_tokens({"embed": {"embedding": t}}, ids) * g)

    def autodiff(t):
        return jnp.sum(jnp.take(t, ids, axis=0, mode="clip") * g)

    np.testing.assert_array_equal(jax.grad(ours)(table), jax.grad(autodiff)(table))
    np.testing.assert_array_equal(embed_tokens({"embed": {"embedding": table}}, ids),
                                  jnp.take(table, ids, axis=0, mode="clip"))


def _loss(forward_fn):
    def loss(params, tokens):
        hidden = forward_fn(params, CFG, tokens, return_hidden=True)
        return -jnp.sum(head_logprobs(params, hidden[:, :-1], tokens[:, 1:])[0])
    return loss


@pytest.fixture(scope="module")
def dp8():
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    mesh = make_mesh(jax.devices()[:8], Layout(), dp=8)
    params = init_params(CFG, seed=0)
    tokens = jax.random.randint(jax.random.key(2), (16, 24), 0, QWEN3_VOCAB)
    whole, rows = NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, PartitionSpec("dp"))
    return mesh, params, tokens, whole, rows


@pytest.fixture(scope="module")
def programs(dp8):
    """The dp 8 gradient program through autodiff's gather ("plain") and through the stage forward, which
    gathers the lookup's cotangents ("gathered"), compiled once."""
    mesh, params, tokens, whole, rows = dp8
    return {name: jax.jit(jax.grad(_loss(fn)), in_shardings=(whole, rows), out_shardings=whole).lower(
        params, tokens).compile() for name, fn in (("plain", forward), ("gathered", pipeline_forward_fn(mesh, 1)))}


def test_dp_gradients_with_the_gathered_lookup_equal_autodiffs(dp8, programs):
    """Against the same dp program differentiated through the gather (each replica's partial table summed over
    dp): equal but for the order of the table's sums (within 1e-6 of values up to ~5); and no farther from
    the single-device gradient than that program is, give or take one float32 rounding of the largest value."""
    _, params, tokens, _, _ = dp8
    single = jax.jit(jax.grad(_loss(forward)))(params, tokens)
    plain, grads = (programs[name](params, tokens) for name in ("plain", "gathered"))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6, rtol=0), grads, plain)
    for ours, theirs, ref in zip(*map(jax.tree.leaves, (grads, plain, single)), strict=True):
        ulp = np.spacing(np.max(np.abs(ref)))
        assert np.max(np.abs(ours - ref)) <= np.max(np.abs(theirs - ref)) + ulp


def test_the_gathered_lookup_saves_a_vocabulary_sized_buffer(programs):
    """Without the gather, each replica scatters its own tokens into a table-sized partial sum that is then
    all-reduced and added to the head's gradient; with it, the scatter adds into the head's gradient in place."""
    table = QWEN3_VOCAB * CFG.hidden_size * 4
    temp = {name: c.memory_analysis().temp_size_in_bytes for name, c in programs.items()}
    assert temp["plain"] - temp["gathered"] >= table, (temp, table)
    assert _gathers_ids(programs["gathered"].as_text())


def _gathers_ids(hlo: str) -> bool:
    """Whether a compiled program all-gathers the [16, 24] int32 token ids over the replicas."""
    return re.search(r"= s32\[16,24\]\{[0-9,]*\} all-gather\(", hlo) is not None


def test_a_batch_with_more_tokens_than_rows_keeps_the_per_replica_scatter(dp8):
    """Gathering every token's cotangent costs more than the table it saves once the batch has more tokens
    than the vocabulary has rows: the gradient is then the plain all-reduced one (same values)."""
    mesh, params, _, whole, rows = dp8
    small = dataclasses.replace(CFG, vocab_size=64)
    params = init_params(small, seed=0)
    tokens = jax.random.randint(jax.random.key(3), (16, 24), 0, 64)

    def loss(forward_fn):
        return lambda p, t: jnp.sum(forward_fn(p, small, t, return_hidden=True) ** 2)

    def grad(forward_fn):
        return jax.jit(jax.grad(loss(forward_fn)), in_shardings=(whole, rows), out_shardings=whole).lower(
            params, tokens).compile()

    fn = grad(pipeline_forward_fn(mesh, 1))
    jax.tree.map(np.testing.assert_array_equal, fn(params, tokens), grad(forward)(params, tokens))
    assert not _gathers_ids(fn.as_text())  # ids stay split; the same check sees the gather in the case above
