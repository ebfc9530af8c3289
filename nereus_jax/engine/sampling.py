"""Token sampling for the engine: temperature, top-k, top-p and greedy, per slot, under jit.

Every request carries its own sampling parameters and random-stream identity as arrays (one entry per
prompt row or decode slot, :class:`Requests`), so one compiled decode step serves any mix of requests.
The random key of a token is ``fold_in(key(seed), prompt, sample, index)`` with ``index`` the token's
place in the response: never the slot, the batch size or the layout, so changing those never changes
what is drawn. Each token takes ONE uniform number and inverts the cumulative distribution (two-level,
so a pass over the vocabulary costs about as much as a softmax); top-k and top-p thresholds are found by
bisection over the float bits (exact, and far cheaper than a sort on XLA:CPU).

The returned log-probability is ``log_softmax(logits / temperature)`` at the chosen token (plain
``log_softmax(logits)`` when greedy); top-k / top-p truncation does not renormalise it.

Each row's draw reads only its own row, so :func:`sample_blocks` runs :func:`sample` over blocks of rows:
with a real vocabulary (151,936 tokens) the working arrays of the threshold search and the inverse CDF
(several ``[rows, vocab]`` float32 arrays) then exist for one block at a time, beside the logits
themselves, whatever the number of decode slots.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from nereus_jax.config import RolloutConfig

_BLOCK = 128  # vocabulary block of the two-level inverse CDF
SAMPLE_BLOCK_ELEMENTS = 2**22  # rows x vocab of one block of sample_blocks (16 MiB of float32 per array)


class SamplingError(ValueError):
    """Sampling parameters that cannot be used; the message names the parameter."""


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How the driver samples one batch of prompts (the same for every prompt of the call)."""

    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    max_new_tokens: int = 32
    stop_tokens: tuple[int, ...] = ()
    n: int = 1  # samples per prompt; they share one prefill
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_tokens", tuple(int(t) for t in self.stop_tokens))
        if self.temperature < 0:
            raise SamplingError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise SamplingError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise SamplingError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")
        if self.max_new_tokens < 1:
            raise SamplingError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.n < 1:
            raise SamplingError(f"n (samples per prompt) must be >= 1, got {self.n}")
        if not 0 <= self.seed < 2**31:
            raise SamplingError(f"seed must be in [0, 2**31), got {self.seed}")

    @classmethod
    def from_rollout(cls, rollout: RolloutConfig, stop_tokens: Sequence[int] = ()) -> SamplingParams:
        """The sampling a job's ``rollout`` section asks for."""
        return cls(temperature=rollout.temperature, top_k=rollout.top_k, top_p=rollout.top_p,
                   max_new_tokens=rollout.max_response_length, stop_tokens=tuple(stop_tokens),
                   n=rollout.samples_per_prompt, seed=rollout.seed)


class Requests(NamedTuple):
    """Per-request sampling state, one entry per prompt row (in a prefix) or per decode slot."""

    seed: jax.Array  # [n] int32
    prompt: jax.Array  # [n] int32  prompt index: the request's identity in the random stream
    sample: jax.Array  # [n] int32  sample index within the prompt
    temperature: jax.Array  # [n] float32, 0 = greedy
    top_k: jax.Array  # [n] int32, 0 = off
    top_p: jax.Array  # [n] float32, 1 = off
    limit: jax.Array  # [n] int32  most tokens to generate (the first one, from prefill, included)
    stop: jax.Array  # [n, max_stop] int32  stop tokens, -1 = unused


def make_requests(rows: int, max_stop: int, *, seed: int = 0, prompt: Sequence[int] | int | None = None,
                  temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                  limit: Sequence[int] | int = 1, stop_tokens: Sequence[int] = ()) -> Requests:
    """Host (numpy) Requests for ``rows`` prompts; ``prompt`` defaults to 0..rows-1."""
    if len(stop_tokens) > max_stop:
        raise SamplingError(f"{len(stop_tokens)} stop tokens given, the engine holds at most {max_stop} "
                            "(raise the engine's max_stop_tokens)")
    prompt = np.arange(rows) if prompt is None else prompt
    stop = np.full((rows, max_stop), -1, np.int32)
    stop[:, : len(stop_tokens)] = np.asarray(stop_tokens, np.int32)
    full = lambda value, dtype: np.broadcast_to(np.asarray(value, dtype), (rows,)).copy()  # noqa: E731
    return Requests(full(seed, np.int32), full(prompt, np.int32), np.zeros(rows, np.int32),
                    full(temperature, np.float32), full(top_k, np.int32), full(top_p, np.float32),
                    full(limit, np.int32), stop)


def token_keys(seed_n: jax.Array, prompt_n: jax.Array, sample_n: jax.Array, index_n: jax.Array) -> jax.Array:
    """The random key of each token: fold_in(key(seed), prompt, sample, index). Traceable."""
    def one(seed, prompt, sample, index):
        key = jax.random.key(seed)
        for part in (prompt, sample, index):
            key = jax.random.fold_in(key, part)
        return key

    return jax.vmap(one)(seed_n, prompt_n, sample_n, index_n)


def sample(logits_nv: jax.Array, requests: Requests, index_n: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Draws one token per row of ``logits_nv`` [n, vocab] under that row's request, as token ``index_n``
    of its response. Returns (tokens [n] int32, log-probabilities [n] float32)."""
    logits_nv = logits_nv.astype(jnp.float32)
    greedy = requests.temperature <= 0
    scaled = logits_nv / jnp.where(greedy, 1.0, requests.temperature)[:, None]
    lse = jax.nn.logsumexp(scaled, axis=-1)
    wants_filter = ~greedy & ((requests.top_k > 0) | (requests.top_p < 1))
    threshold = jax.lax.cond(jnp.any(wants_filter), _filter_threshold, _no_threshold,
                             scaled, requests.top_k, requests.top_p)
    keys = token_keys(requests.seed, requests.prompt, requests.sample, index_n)
    uniform = jax.vmap(jax.random.uniform)(keys)
    drawn = _inverse_cdf(jnp.where(scaled >= threshold[:, None], scaled, -jnp.inf), uniform)
    tokens = jnp.where(greedy, _argmax(scaled), drawn)
    logprobs = jnp.take_along_axis(scaled, tokens[:, None], axis=-1)[:, 0] - lse
    return tokens, logprobs


def block_rows(vocab: int, elements: int = SAMPLE_BLOCK_ELEMENTS) -> int:
    """Rows of one :func:`sample_blocks` block for a vocabulary of ``vocab`` tokens (at least 1)."""
    return max(1, elements // max(vocab, 1))


def sample_blocks(logits_rv: jax.Array, requests: Requests, index_n: jax.Array, repeat: int = 1,
                  rows_per_block: int | None = None) -> tuple[jax.Array, jax.Array]:
    """:func:`sample` with each row of ``logits_rv`` [r, vocab] repeated ``repeat`` times (row i's copies
    are rows ``i * repeat ..`` of ``requests`` / ``index_n``, n = r * repeat), over blocks of
    ``rows_per_block`` rows of the repeated logits (default :func:`block_rows`) one after another, so
    sampling holds ``[block, vocab]`` working arrays, not ``[n, vocab]``. Draws exactly what
    :func:`sample` draws on the whole (each row's result depends on that row alone)."""
    r, v = logits_rv.shape
    n = r * repeat
    per_block = max(1, (rows_per_block or block_rows(v)) // repeat)  # logits rows per block
    if per_block >= r:
        rows = logits_rv if repeat == 1 else jnp.repeat(logits_rv, repeat, axis=0)
        return sample(rows, requests, index_n)

    def one(start: int | jax.Array, rows: int) -> tuple[jax.Array, jax.Array]:  # logits rows start..start+rows
        logits = jax.lax.dynamic_slice_in_dim(logits_rv, start, rows)
        logits = logits if repeat == 1 else jnp.repeat(logits, repeat, axis=0)
        take = lambda x: jax.lax.dynamic_slice_in_dim(x, start * repeat, rows * repeat)  # noqa: E731
        return sample(logits, jax.tree.map(take, requests), take(index_n))

    def block(i, carry):  # in place: no padded or regrouped copy of the logits
        tokens, logprobs = carry
        t, lp = one(i * per_block, per_block)
        at = i * per_block * repeat
        return (jax.lax.dynamic_update_slice_in_dim(tokens, t, at, 0),
                jax.lax.dynamic_update_slice_in_dim(logprobs, lp, at, 0))

    full, rest = divmod(r, per_block)
    carry = (jnp.zeros((n,), jnp.int32), jnp.zeros((n,), jnp.float32))
    tokens, logprobs = jax.lax.fori_loop(0, full, block, carry)
    if rest:
        t, lp = one(full * per_block, rest)
        tokens, logprobs = tokens.at[full * per_block * repeat:].set(t), logprobs.at[full * per_block * repeat:].set(lp)
    return tokens, logprobs


def _argmax(x_nv: jax.Array) -> jax.Array:
    """First index of the maximum (jnp.argmax's variadic reduce is slower on XLA:CPU)."""
    iota = jnp.arange(x_nv.shape[-1], dtype=jnp.int32)
    return jnp.min(jnp.where(x_nv == jnp.max(x_nv, -1, keepdims=True), iota, x_nv.shape[-1]), axis=-1)


def _last_positive(w_nv: jax.Array) -> jax.Array:
    iota = jnp.arange(w_nv.shape[-1], dtype=jnp.int32)
    return jnp.max(jnp.where(w_nv > 0, iota, 0), axis=-1)


def _inverse_cdf(masked_nv: jax.Array, uniform_n: jax.Array) -> jax.Array:
    """Index i with cdf[i-1] <= u * total < cdf[i] (so never a zero-probability token), in two levels:
    vocabulary blocks first, then the chosen block."""
    n, v = masked_nv.shape
    block = min(_BLOCK, v)
    blocks = -(-v // block)
    weights = jnp.exp(masked_nv - jnp.max(masked_nv, -1, keepdims=True))
    weights = jnp.pad(weights, ((0, 0), (0, blocks * block - v))).reshape(n, blocks, block)
    block_mass = jnp.sum(weights, -1)
    block_cdf = jnp.cumsum(block_mass, -1)
    target = uniform_n * block_cdf[:, -1]
    b = jnp.minimum(jnp.sum(block_cdf <= target[:, None], -1), _last_positive(block_mass))
    before = jnp.where(b > 0, jnp.take_along_axis(block_cdf, jnp.maximum(b - 1, 0)[:, None], -1)[:, 0], 0.0)
    row = jnp.take_along_axis(weights, b[:, None, None], axis=1)[:, 0]
    within = jnp.minimum(jnp.sum(jnp.cumsum(row, -1) + before[:, None] <= target[:, None], -1), _last_positive(row))
    return (b * block + within).astype(jnp.int32)


def _no_threshold(scaled_nv, top_k_n, top_p_n):
    return jnp.full(scaled_nv.shape[:1], -jnp.inf, scaled_nv.dtype)


def _filter_threshold(scaled_nv, top_k_n, top_p_n):
    """The smallest logit a row may still emit under its top-k, then top-p (-inf where neither is on)."""
    keys = _sortable(scaled_nv)
    k = jnp.clip(top_k_n, 1, scaled_nv.shape[-1])
    rows = scaled_nv.shape[0]
    kth = _largest_key(rows, lambda t: jnp.sum(keys >= t[:, None], -1) >= k)
    kth = jnp.where(top_k_n > 0, kth, jnp.uint32(0))
    kept = jnp.where(keys >= kth[:, None], scaled_nv, -jnp.inf)
    probs = jax.nn.softmax(kept, axis=-1)
    pth = _largest_key(rows, lambda t: jnp.sum(jnp.where(keys >= t[:, None], probs, 0.0), -1) >= top_p_n)
    pth = jnp.where(top_p_n < 1, pth, jnp.uint32(0))
    bound = jnp.maximum(kth, pth)
    return jnp.where(bound > 0, _unsortable(bound), -jnp.inf)


def _largest_key(rows: int, holds) -> jax.Array:
    """Per row, the largest uint32 t with holds(t) (holds is monotone: true up to some t, false after;
    holds(0) is assumed), found bit by bit from the top."""
    def body(i, t):
        candidate = t | (jnp.uint32(1) << (31 - i).astype(jnp.uint32))
        return jnp.where(holds(candidate), candidate, t)

    return jax.lax.fori_loop(0, 32, body, jnp.zeros((rows,), jnp.uint32))


def _sortable(x: jax.Array) -> jax.Array:
    """float32 -> uint32 preserving order (-inf -> small, +inf -> large)."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


def _unsortable(t: jax.Array) -> jax.Array:
    bits = jnp.where(t >> 31 == 1, t & jnp.uint32(0x7FFFFFFF), ~t)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)
