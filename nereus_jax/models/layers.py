"""Building blocks of the Llama/Qwen2/Qwen3 decoder as pure functions over arrays.

Shapes are spelled in names: b batch, t query length, s key length, d embed, h query heads,
k kv heads, g query heads per kv head, e head_dim, f mlp, v vocab. No mesh names appear here; the
only sharding hook is :func:`constrain`, which applies whatever logical-axis rules the caller set.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

# A hook (array, logical axis names) -> array, installed by nereus_jax.sharding while tracing under a mesh.
_CONSTRAIN: contextvars.ContextVar[Callable | None] = contextvars.ContextVar("nereus_constrain", default=None)
# A hook running the routed experts expert-parallel (same signature as experts_mlp), installed likewise.
_EXPERTS: contextvars.ContextVar[Callable | None] = contextvars.ContextVar("nereus_experts", default=None)
# A hook array -> array making a (small) value whole on every device of the mesh, installed likewise: the
# embedding lookup's backward gathers its tokens' cotangents with it (models/decoder.py).
_REPLICATE: contextvars.ContextVar[Callable | None] = contextvars.ContextVar("nereus_replicate", default=None)
_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


@contextlib.contextmanager
def activation_constraints(fn: Callable[[jax.Array, Sequence[str | None]], jax.Array]) -> Iterator[None]:
    """Within this context, :func:`constrain` calls ``fn(x, logical_axes)``."""
    token = _CONSTRAIN.set(fn)
    try:
        yield
    finally:
        _CONSTRAIN.reset(token)


@contextlib.contextmanager
def replication(fn: Callable[[jax.Array], jax.Array]) -> Iterator[None]:
    """Within this context, :func:`current_replication` is ``fn`` (x -> x whole on every device)."""
    token = _REPLICATE.set(fn)
    try:
        yield
    finally:
        _REPLICATE.reset(token)


def current_replication() -> Callable[[jax.Array], jax.Array] | None:
    """The active :func:`replication` hook, or None: read by a custom VJP's forward, since JAX traces its
    backward rule later, outside the context."""
    return _REPLICATE.get()


@contextlib.contextmanager
def expert_parallel(fn: Callable[..., jax.Array]) -> Iterator[None]:
    """Within this context, :func:`routed_experts` calls ``fn`` (same arguments as :func:`experts_mlp`): the
    sharding package's expert-parallel layer (:mod:`nereus_jax.sharding.experts`)."""
    token = _EXPERTS.set(fn)
    try:
        yield
    finally:
        _EXPERTS.reset(token)


def constrain(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
    """Annotates an activation with logical axis names (a no-op unless a sharding context is active)."""
    fn = _CONSTRAIN.get()
    return x if fn is None else fn(x, tuple(logical_axes))


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """RMSNorm computed in float32, as Hugging Face's LlamaRMSNorm does."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (scale.astype(jnp.float32) * y.astype(x.dtype).astype(jnp.float32)).astype(x.dtype)


def project_heads(h_btd: jax.Array, w_dhe: jax.Array, b_he: jax.Array | None = None,
                  norm_scale_e: jax.Array | None = None, eps: float = 1e-6) -> jax.Array:
    """Hidden states to per-head queries, keys or values [b, t, heads, e]: the projection, its bias
    (Qwen2), then RMSNorm over each head's e (Qwen3's q_norm/k_norm, applied before RoPE)."""
    y = jnp.einsum("btd,dhe->bthe", h_btd, w_dhe)
    if b_he is not None:
        y = y + b_he
    return y if norm_scale_e is None else rms_norm(y, norm_scale_e, eps)


def rope_inv_freq(head_dim: int, theta: float, scaling=None) -> np.ndarray:
    """Inverse RoPE frequencies [head_dim // 2], with optional Llama-3 frequency scaling (float32)."""
    exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv_freq = (np.float32(1.0) / (np.float32(theta) ** exponent)).astype(np.float32)
    if scaling is None:
        return inv_freq
    return _llama3_scale(inv_freq, scaling)


def _llama3_scale(inv_freq: np.ndarray, s) -> np.ndarray:
    old_len = float(s.original_max_position_embeddings)
    low_wavelen = old_len / s.low_freq_factor
    high_wavelen = old_len / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def apply_rope(x_bthe: jax.Array, positions_bt: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotary embedding in the rotate-half convention (Hugging Face Llama/Qwen2)."""
    freqs = positions_bt.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)[None, None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    x32 = x_bthe.astype(jnp.float32)
    half = x32.shape[-1] // 2
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    return (x32 * cos + rotated * sin).astype(x_bthe.dtype)


def attention(q_bthe: jax.Array, k_bkse: jax.Array, v_bkse: jax.Array, mask_bts: jax.Array) -> jax.Array:
    """Grouped-query attention; softmax in float32. Returns [b, t, h, e]."""
    b, t, h, e = q_bthe.shape
    k = k_bkse.shape[1]
    q = q_bthe.reshape(b, t, k, h // k, e)
    scores = jnp.einsum("btkge,bkse->bkgts", q, k_bkse).astype(jnp.float32) / np.float32(math.sqrt(e))
    scores = jnp.where(mask_bts[:, None, None, :, :], scores, _MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_bkse.dtype)
    out = jnp.einsum("bkgts,bkse->btkge", probs, v_bkse)
    return out.reshape(b, t, h, e)


def swiglu(x_btd: jax.Array, w_gate_df: jax.Array, w_up_df: jax.Array, w_down_fd: jax.Array) -> jax.Array:
    """SwiGLU MLP: down(silu(gate(x)) * up(x))."""
    gate = jnp.einsum("btd,df->btf", x_btd, w_gate_df)
    up = jnp.einsum("btd,df->btf", x_btd, w_up_df)
    hidden = constrain(jax.nn.silu(gate) * up, ("batch", "length", "mlp"))
    return jnp.einsum("btf,fd->btd", hidden, w_down_fd)


class Routed(NamedTuple):
    """One mixture-of-experts layer's routing of its tokens."""

    weights: jax.Array  # [b, t, k] in x's dtype: the gate weight of each expert used
    experts: jax.Array  # [b, t, k] int32: the experts used (the forced ones where routes were forced)
    own: jax.Array      # [b, t, k] int32: the router's own top-k (equal to ``experts`` without forcing)
    probs: jax.Array    # [b, t, experts] float32: the router's softmax (what the load-balancing loss reads)


def route(x_btd: jax.Array, router_de: jax.Array, k: int, norm_topk: bool,
          forced_btk: jax.Array | None = None) -> Routed:
    """Qwen3-MoE's router: softmax over the experts in float32, the top ``k`` (ties to the lower index), their
    weights renormalised to sum to 1 when ``norm_topk``.

    ``forced_btk`` (routing replay: the experts another run chose, -1 where it recorded none) replaces the
    top-k of every token whose k entries are all recorded; the gate weights are still this router's softmax at
    those experts (renormalised alike), so the router keeps its gradient."""
    logits = jnp.einsum("btd,de->bte", x_btd, router_de).astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    top, own = jax.lax.top_k(probs, k)
    own = own.astype(jnp.int32)
    experts, weights = own, top
    if forced_btk is not None:
        use = jnp.all(forced_btk >= 0, axis=-1, keepdims=True)
        experts = jnp.where(use, forced_btk.astype(jnp.int32), own)
        weights = jnp.take_along_axis(probs, experts, axis=-1)
    if norm_topk:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return Routed(weights.astype(x_btd.dtype), experts, own, probs)


def same_experts(a_btk: jax.Array, b_btk: jax.Array) -> jax.Array:
    """[b, t] bool: the two top-k lists name the same set of experts (order ignored)."""
    return jnp.all(jnp.sort(a_btk, axis=-1) == jnp.sort(b_btk.astype(a_btk.dtype), axis=-1), axis=-1)


def moe_mlp(x_btd: jax.Array, router_de: jax.Array, w_gate_edf: jax.Array, w_up_edf: jax.Array,
            w_down_efd: jax.Array, k: int, norm_topk: bool, *, impl: str | None = None) -> jax.Array:
    """A dropless mixture of SwiGLU experts on the router's own top-k (:func:`route`, :func:`experts_mlp`)."""
    return experts_mlp(x_btd, route(x_btd, router_de, k, norm_topk), w_gate_edf, w_up_edf, w_down_efd, impl=impl)


GROUPED_IMPLS = ("ragged_dot", "blocks")


def grouped_impl() -> str:
    """The grouped-matmul implementation :func:`experts_mlp` uses by default on the default backend: XLA's
    ragged dot where it has one (GPU, TPU), else ``blocks`` (XLA:CPU lowers ``lax.ragged_dot`` to a dense
    contraction over every expert, experts / top_k times the routed FLOPs)."""
    return "ragged_dot" if jax.default_backend() in ("gpu", "cuda", "rocm", "tpu") else "blocks"


def routed_experts(x_btd: jax.Array, routed: Routed, w_gate_edf: jax.Array, w_up_edf: jax.Array,
                   w_down_efd: jax.Array) -> jax.Array:
    """The model's routed-experts layer: :func:`experts_mlp`, or the expert-parallel hook a caller installed
    (:func:`expert_parallel`), which computes the same function with the experts split over devices."""
    fn = _EXPERTS.get()
    return experts_mlp(x_btd, routed, w_gate_edf, w_up_edf, w_down_efd) if fn is None else \
        fn(x_btd, routed, w_gate_edf, w_up_edf, w_down_efd)


def experts_mlp(x_btd: jax.Array, routed: Routed, w_gate_edf: jax.Array, w_up_edf: jax.Array,
                w_down_efd: jax.Array, *, impl: str | None = None, block_rows: int | None = None) -> jax.Array:
    """Every token's routed experts, as grouped matmuls over the token-expert pairs sorted by expert (dropless:
    no capacity, no dropped tokens), then each token's outputs summed with its routing weights.

    ``impl`` (default :func:`grouped_impl`): ``ragged_dot`` runs each of the SwiGLU's three matmuls as one
    ``lax.ragged_dot`` over the groups; ``blocks`` cuts each expert's group into ``block_rows``-row blocks and
    runs the SwiGLU block by block in a scan, each block against its expert's weights (the routed FLOPs plus
    at most a block of padding per expert; :func:`blocked_swiglu`)."""
    pairs = _grouped_pairs(x_btd, routed.experts, w_gate_edf, w_up_edf, w_down_efd, impl, block_rows)
    return jnp.einsum("btkd,btk->btd", pairs, routed.weights)


def local_experts_mlp(x_btd: jax.Array, routed: Routed, w_gate_edf: jax.Array, w_up_edf: jax.Array,
                      w_down_efd: jax.Array, first: jax.Array | int, *, impl: str | None = None,
                      block_rows: int | None = None) -> jax.Array:
    """The part of :func:`experts_mlp` that experts ``first .. first + E_l - 1`` compute, holding only their
    weights (``w_*`` [E_l, ...]): the pairs routed to them, grouped and multiplied as there, weighted and summed
    per token; every other pair contributes 0. Summing this over a partition of the experts gives
    :func:`experts_mlp` (up to the order of the sum). Pairs routed elsewhere sort after the local groups (id
    E_l, counted in no group), so neither grouped matmul computes them: the routed FLOPs of the local experts."""
    local = w_gate_edf.shape[0]
    experts = routed.experts - first
    mine = (experts >= 0) & (experts < local)
    pairs = _grouped_pairs(x_btd, jnp.where(mine, experts, local), w_gate_edf, w_up_edf, w_down_efd, impl,
                           block_rows)
    return jnp.einsum("btkd,btk->btd", jnp.where(mine[..., None], pairs, 0), routed.weights)


def _grouped_pairs(x_btd, experts_btk, w_gate_edf, w_up_edf, w_down_efd, impl, block_rows) -> jax.Array:
    """[b, t, k, d]: each (token, k) pair's expert SwiGLU, computed as grouped matmuls over the pairs sorted by
    expert. Pairs whose expert id is ``E`` (= w_gate_edf.shape[0], out of range) sort last and are not computed
    (their rows are 0 with ``blocks``; whatever ``ragged_dot`` leaves past its groups otherwise)."""
    b, t, d = x_btd.shape
    k, num_experts = experts_btk.shape[-1], w_gate_edf.shape[0]
    impl = impl or grouped_impl()
    if impl not in GROUPED_IMPLS:
        raise ValueError(f"impl must be one of {GROUPED_IMPLS}, got {impl!r}")
    flat_e = experts_btk.reshape(-1)                    # [b*t*k] the expert of each pair
    order = jnp.argsort(flat_e, stable=True)            # pairs grouped by expert
    group_sizes = jnp.bincount(flat_e, length=num_experts).astype(jnp.int32)
    xs = x_btd.reshape(b * t, d)[order // k]            # each sorted pair's token
    if impl == "ragged_dot":
        gate = jax.lax.ragged_dot(xs, w_gate_edf, group_sizes)
        up = jax.lax.ragged_dot(xs, w_up_edf, group_sizes)
        ys = jax.lax.ragged_dot(jax.nn.silu(gate) * up, w_down_efd, group_sizes)   # [b*t*k, d] sorted
    else:
        block = block_rows or default_block_rows(b * t * k, num_experts)
        ys = blocked_swiglu(xs, group_sizes, w_gate_edf, w_up_edf, w_down_efd, block)
    return ys[jnp.argsort(order)].reshape(b, t, k, d)  # back in (token, k) order


def default_block_rows(pairs: int, num_experts: int) -> int:
    """Rows per block of :func:`blocked_swiglu`: the power of two at or below the mean group, from 8 to 256.
    At most a block of padding per expert, so at most about as many padded rows as routed ones; each block
    reads its expert's weights again, so larger blocks pay when groups are large (tools/bench_moe.py
    --block-rows measured 64 to 256 best on XLA:CPU)."""
    mean = max(1, pairs // max(1, num_experts))
    return int(min(256, max(8, 2 ** int(math.log2(mean)))))


def blocked_swiglu(xs_nd: jax.Array, group_sizes: jax.Array, w_gate_edf: jax.Array, w_up_edf: jax.Array,
                   w_down_efd: jax.Array, block: int) -> jax.Array:
    """The SwiGLU of each row of ``xs_nd`` (rows sorted by expert, ``group_sizes`` [experts] rows each) with its
    expert's weights: a scan over blocks of ``block`` rows, expert e's group cut into ceil(size / block) blocks
    (a static bound on their number: (rows + experts (block - 1)) / block; blocks left over are empty). A
    block's rows past its group's end are computed too (with the wrong expert) and dropped.

    Its gradient is written out (:func:`_blocked_swiglu_bwd`): a scan over the blocks for the input gradient,
    then the weight gradients as one batched matmul over the blocks summed per expert. Differentiating the
    forward scan instead adds a whole [experts, ...] zero-padded weight gradient per block."""
    expert, row, valid = _block_plan(xs_nd.shape[0], group_sizes, w_gate_edf.shape[0], block)
    return _blocked_swiglu(xs_nd, expert, row, valid, w_gate_edf, w_up_edf, w_down_efd)


def _block_plan(n: int, group_sizes: jax.Array, num_experts: int, block: int):
    """Each block's expert [blocks], its rows [blocks, block] (``n``, a padding row, past the end) and which of
    them belong to its expert's group [blocks, block], in group order."""
    blocks = (group_sizes + block - 1) // block                      # [experts]
    ends = jnp.cumsum(blocks)
    i = jnp.arange((n + num_experts * (block - 1)) // block)
    # searchsorted(ends, i, side="right") as a count: jnp.searchsorted fails to trace inside shard_map on jax
    # 0.10.2 (the expert-parallel layer runs this per expert rank)
    after = jnp.sum(ends[None, :] <= i[:, None], axis=1)
    expert = jnp.minimum(after, num_experts - 1).astype(jnp.int32)
    start = jnp.cumsum(group_sizes) - group_sizes                    # each group's first row
    first = start[expert] + (i - (ends - blocks)[expert]) * block
    rows = first[:, None] + jnp.arange(block)[None, :]
    valid = (i < ends[-1])[:, None] & (rows < (start + group_sizes)[expert][:, None])
    return expert, jnp.where(valid, rows, n).astype(jnp.int32), valid


@jax.custom_vjp
def _blocked_swiglu(xs_nd, expert, rows, valid, w_gate_edf, w_up_edf, w_down_efd):
    return _blocked_swiglu_fwd(xs_nd, expert, rows, valid, w_gate_edf, w_up_edf, w_down_efd)[0]


def _blocked_swiglu_fwd(xs_nd, expert, rows, valid, w_gate_edf, w_up_edf, w_down_efd):
    n, d = xs_nd.shape
    padded = jnp.concatenate([xs_nd, jnp.zeros((1, d), xs_nd.dtype)])

    def one(_, blk):
        e, r = blk
        x = padded[r]
        gate, up = x @ w_gate_edf[e], x @ w_up_edf[e]
        return None, ((jax.nn.silu(gate) * up) @ w_down_efd[e], gate, up)

    _, (y, gate, up) = jax.lax.scan(one, None, (expert, rows))
    out = jnp.zeros((n + 1, d), y.dtype).at[rows].add(jnp.where(valid[..., None], y, 0))[:n]
    return out.astype(xs_nd.dtype), (padded, expert, rows, valid, gate, up, w_gate_edf, w_up_edf, w_down_efd)


def _blocked_swiglu_bwd(res, dys_nd):
    """The input gradient block by block (a scan: each block against its expert's weights), the weight
    gradients as batched matmuls over the blocks summed per expert (the blocks are in expert order)."""
    padded, expert, rows, valid, gate, up, w_gate, w_up, w_down = res
    n, d = dys_nd.shape
    g = jnp.where(valid[..., None], jnp.concatenate([dys_nd, jnp.zeros((1, d), dys_nd.dtype)])[rows], 0)

    def one(_, blk):
        e, g, a, u = blk
        dh = g @ w_down[e].T
        sig = jax.nn.sigmoid(a)
        da = dh * u * sig * (1 + a * (1 - sig))      # d silu(a) / da = sig (1 + a (1 - sig))
        du = dh * a * sig
        return None, (da @ w_gate[e].T + du @ w_up[e].T, da, du)

    _, (dx, da, du) = jax.lax.scan(one, None, (expert, g, gate, up))
    dxs = jnp.zeros((n + 1, d), dx.dtype).at[rows].add(dx)[:n]
    per_expert = lambda x, y: jax.ops.segment_sum(jnp.einsum("nbi,nbj->nij", x, y), expert,  # noqa: E731
                                                  num_segments=w_gate.shape[0], indices_are_sorted=True)
    xb = padded[rows]
    dwg, dwu, dwd = per_expert(xb, da), per_expert(xb, du), per_expert(jax.nn.silu(gate) * up, g)
    return (dxs.astype(padded.dtype), None, None, None, dwg.astype(w_gate.dtype), dwu.astype(w_up.dtype),
            dwd.astype(w_down.dtype))


_blocked_swiglu.defvjp(_blocked_swiglu_fwd, _blocked_swiglu_bwd)
