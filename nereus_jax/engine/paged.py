"""Paged KV memory for the engine: a shared pool of pages per layer, a page table per slot, a free-page
stack, and decode attention that reads only each slot's live pages (pure functions, traced under jit).

A page holds ``page_size`` consecutive positions of one sequence: ``[kv_heads, page_size, head_dim]`` for
keys and the same for values, in a pool ``[kv_pages, kv_heads, page_size, head_dim]`` per layer (sharded
over kv heads like the unpaged cache). Slot ``s`` holds ``held[s]`` pages, ``table[s, :held[s]]``, and
its position ``p`` lives in page ``table[s, p // page_size]`` at offset ``p % page_size``. Pages come from
the top of the free stack (``free[:free_count]``) and go back onto it; which page a slot gets never
changes what it computes.

Decode attention is ragged: the pages every slot attends to are listed once per step as work items
(slot-major, pages in order; :func:`work_items`), padded to a static count, so the cost follows the
tokens held rather than ``slots x max_target_length``. Each item's scores and values are computed with
fixed shapes; a slot's softmax takes the exact maximum over its items (a scatter-max) and sums its items
in page order (a scatter-add), so a slot's result never depends on the padded item count, on other
slots, or on the capacity: the tokens of a sequence are the same whatever else the engine holds.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)  # as nereus_jax.models.layers


class PageTable(NamedTuple):
    """Who holds which page: per slot its pages in order, and the free pages as a stack."""

    table: jax.Array  # [slots, pages_per_slot] int32: page ids; entries at or past held[s] are stale
    held: jax.Array  # [slots] int32 pages slot s holds
    free: jax.Array  # [kv_pages] int32: free[:free_count] are the free pages (the top is used first)
    free_count: jax.Array  # [] int32


class Items(NamedTuple):
    """One decode step's attention work: the pages every slot attends to, slot-major, padded."""

    slot: jax.Array  # [w] int32 slot of each item; = slots for padding (dropped by the scatters)
    page: jax.Array  # [w] int32 page id
    visible: jax.Array  # [w, page_size] bool: the position is at or before the slot's current token


def empty_table(slots: int, pages_per_slot: int, kv_pages: int) -> PageTable:
    """No slot holds a page; every page is free."""
    return PageTable(jnp.zeros((slots, pages_per_slot), jnp.int32), jnp.zeros((slots,), jnp.int32),
                     jnp.arange(kv_pages, dtype=jnp.int32), jnp.int32(kv_pages))


def allocate(pages: PageTable, new_b: jax.Array) -> tuple[PageTable, jax.Array]:
    """Gives slot b ``new_b[b]`` more pages (appended after the ones it holds), all or nothing per slot, in
    slot order while the free stack lasts. Returns the table and which slots got theirs ([slots] bool)."""
    slots, width = pages.table.shape
    before = jnp.cumsum(new_b) - new_b  # pages taken by the slots before b
    granted = (new_b > 0) & (before + new_b <= pages.free_count)
    j = jnp.arange(width, dtype=jnp.int32)[None, :]
    take = granted[:, None] & (j < new_b[:, None])
    source = jnp.clip(pages.free_count - 1 - (before[:, None] + j), 0, pages.free.shape[0] - 1)
    column = jnp.where(take, pages.held[:, None] + j, width)  # width = out of range: dropped
    rows = jnp.broadcast_to(jnp.arange(slots, dtype=jnp.int32)[:, None], column.shape)
    table = pages.table.at[rows, column].set(pages.free[source], mode="drop")
    taken = jnp.where(granted, new_b, 0)
    return PageTable(table, pages.held + taken, pages.free, pages.free_count - jnp.sum(taken)), granted


def release(pages: PageTable, release_b: jax.Array) -> PageTable:
    """Slots with ``release_b`` give every page they hold back to the free stack."""
    count = jnp.where(release_b, pages.held, 0)
    before = pages.free_count + jnp.cumsum(count) - count
    j = jnp.arange(pages.table.shape[1], dtype=jnp.int32)[None, :]
    dest = jnp.where(j < count[:, None], before[:, None] + j, pages.free.shape[0])  # out of range: dropped
    free = pages.free.at[dest.reshape(-1)].set(pages.table.reshape(-1), mode="drop")
    return PageTable(pages.table, pages.held - count, free, pages.free_count + jnp.sum(count))


def release_if_any(pages: PageTable, release_b: jax.Array) -> PageTable:
    """:func:`release`, skipped (a cheap branch) when no slot releases anything."""
    return jax.lax.cond(jnp.any(release_b & (pages.held > 0)), release, lambda p, _: p, pages, release_b)


def place(pools, pages: PageTable, rows_caches, slots_i: jax.Array, lengths_i: jax.Array):
    """Puts contiguous caches (per layer (k, v) [n, kv_heads, length, head_dim], row i's first
    ``lengths_i[i]`` positions) into fresh pages of slots ``slots_i`` (ids past the slots are padding),
    after taking back whatever those slots held. A row of length 0 gets no page; a row the pool cannot
    hold gets none either. Returns the pools, the table and which rows were placed ([n] bool)."""
    slots, size = pages.table.shape[0], pools[0][0].shape[2]
    pages = release(pages, jnp.zeros((slots,), bool).at[slots_i].set(True, mode="drop"))
    need = -(-lengths_i // size)
    pages, granted = allocate(pages, jnp.zeros((slots,), jnp.int32).at[slots_i].set(need, mode="drop"))
    known = jnp.minimum(slots_i, slots - 1)
    placed = (slots_i < slots) & granted[known]
    width = -(-rows_caches[0][0].shape[2] // size)
    j = jnp.arange(width, dtype=jnp.int32)[None, :]
    dest = jnp.where(placed[:, None] & (j < need[:, None]), pages.table[known][:, :width], pools[0][0].shape[0])
    pools = tuple((write_pages(k, rk, dest), write_pages(v, rv, dest))
                  for (k, v), (rk, rv) in zip(pools, rows_caches, strict=True))
    return pools, pages, placed


def grow(pages: PageTable, positions_b: jax.Array, active_b: jax.Array, page_size: int):
    """Before a decode step: an active slot whose position starts a page it does not hold takes one.
    Returns the table, which slots step (the others found no free page and wait) and the page each writes
    to (past the pool for those that do not step)."""
    need = active_b & (pages.held * page_size <= positions_b)
    pages, granted = allocate(pages, need.astype(jnp.int32))
    run = active_b & (~need | granted)
    page = pages.table[jnp.arange(pages.table.shape[0]), positions_b // page_size]
    return pages, run, jnp.where(run, page, pages.free.shape[0])


def take_out(pools, pages: PageTable, slot: jax.Array, count: int):
    """Slot ``slot``'s first ``count`` pages copied out of every pool, and all its pages freed. Returns
    the table, the copies (per layer (k, v) [count, kv_heads, page_size, head_dim]) and how many it held."""
    ids = jax.lax.dynamic_slice_in_dim(pages.table[slot], 0, count)
    copies = tuple((gather_pages(k, ids), gather_pages(v, ids)) for k, v in pools)
    held = pages.held[slot]
    return release(pages, jnp.arange(pages.table.shape[0]) == slot), copies, held


def put_back(pools, pages: PageTable, slot: jax.Array, copies, held: jax.Array):
    """The inverse of :func:`take_out` into fresh pages of ``slot`` (whatever it held is freed first).
    Returns the pools, the table and whether the pool had room (if not, nothing is stored)."""
    mine = jnp.arange(pages.table.shape[0]) == slot
    pages, granted = allocate(release(pages, mine), jnp.where(mine, held, 0))
    count = copies[0][0].shape[0]
    ids = jax.lax.dynamic_slice_in_dim(pages.table[slot], 0, min(count, pages.table.shape[1]))
    dest = jnp.where(granted[slot] & (jnp.arange(count) < held), ids, pages.free.shape[0])
    pools = tuple((k.at[dest].set(ck, mode="drop"), v.at[dest].set(cv, mode="drop"))
                  for (k, v), (ck, cv) in zip(pools, copies, strict=True))
    return pools, pages, granted[slot]


def work_items(pages: PageTable, positions_b: jax.Array, attending_b: jax.Array, count: int,
               page_size: int) -> Items:
    """The pages each attending slot reads at a decode step whose token sits at ``positions_b``: pages
    ``0 .. positions_b // page_size``, slot-major, padded to ``count`` items (which must cover them all)."""
    slots = pages.table.shape[0]
    per_slot = jnp.where(attending_b, positions_b // page_size + 1, 0)
    ends = jnp.cumsum(per_slot)
    w = jnp.arange(count, dtype=jnp.int32)
    slot = jnp.sum(ends[None, :] <= w[:, None], axis=1, dtype=jnp.int32)  # = slots past the last item
    known = jnp.minimum(slot, slots - 1)
    index = w - jnp.where(slot > 0, ends[jnp.maximum(slot - 1, 0)], 0)
    page = pages.table[known, jnp.clip(index, 0, pages.table.shape[1] - 1)]
    position = index[:, None] * page_size + jnp.arange(page_size, dtype=jnp.int32)[None, :]
    visible = position <= positions_b[known][:, None]
    # materialised once per step: fused into each layer's gathers, the index arithmetic runs per element
    return Items(*jax.lax.optimization_barrier((slot, page, visible)))


def write(pool: jax.Array, new_bke: jax.Array, page_b: jax.Array, offset_b: jax.Array) -> jax.Array:
    """Stores one token's keys or values per slot at (page, offset); a page id past the pool drops it."""
    return pool.at[page_b, :, offset_b].set(new_bke.astype(pool.dtype), mode="drop")


def write_pages(pool: jax.Array, rows_nke: jax.Array, pages_np: jax.Array) -> jax.Array:
    """Stores contiguous rows [n, kv_heads, length, head_dim] into pages ``pages_np`` [n, length /
    page_size] (page ids past the pool are dropped); length is padded up to whole pages."""
    n, k, length, e = rows_nke.shape
    size = pool.shape[2]
    whole = pages_np.shape[1] * size
    rows = jnp.pad(rows_nke, ((0, 0), (0, 0), (0, whole - length), (0, 0)))
    chunks = rows.reshape(n, k, pages_np.shape[1], size, e).transpose(0, 2, 1, 3, 4)
    return pool.at[pages_np.reshape(-1)].set(chunks.reshape(-1, k, size, e).astype(pool.dtype), mode="drop")


def attend(q_bhe: jax.Array, k_pool: jax.Array, v_pool: jax.Array, items: Items) -> jax.Array:
    """Attention of one query token per slot over the slot's pages (ragged): [slots, heads, head_dim].
    Slots without items get zeros."""
    slots, h, e = q_bhe.shape
    k = k_pool.shape[1]
    q = jax.lax.optimization_barrier(q_bhe.reshape(slots, k, h // k, e))  # else RoPE is recomputed per item
    known = jnp.minimum(items.slot, slots - 1)
    keys, values = gather_pages(k_pool, items.page), gather_pages(v_pool, items.page)
    scores = jnp.einsum("wkge,wkpe->wkgp", jnp.take(q, known, axis=0, mode="clip"), keys)
    scores = scores.astype(jnp.float32) / np.float32(math.sqrt(e))
    scores = jnp.where(items.visible[:, None, None, :], scores, _MASK_VALUE)
    top = jnp.full((slots, k, h // k), _MASK_VALUE, jnp.float32)
    top = top.at[items.slot].max(jnp.max(scores, axis=-1), mode="drop")
    probs = jnp.exp(scores - jnp.take(top, known, axis=0, mode="clip")[..., None])
    total = jnp.zeros((slots, k, h // k), jnp.float32).at[items.slot].add(jnp.sum(probs, -1), mode="drop")
    part = jnp.einsum("wkgp,wkpe->wkge", probs.astype(values.dtype), values).astype(jnp.float32)
    out = jnp.zeros((slots, k, h // k, e), jnp.float32).at[items.slot].add(part, mode="drop")
    out = out / jnp.where(total > 0, total, 1.0)[..., None]
    return out.reshape(slots, h, e).astype(q_bhe.dtype)


def gather_pages(pool: jax.Array, pages_n: jax.Array) -> jax.Array:
    """Pages ``pages_n`` of a pool, [n, kv_heads, page_size, head_dim] (ids are clipped into the pool).
    Gathered as rows of a 2-d view: XLA:CPU copies whole rows then, faster than a 4-d gather."""
    rows = jnp.take(pool.reshape(pool.shape[0], -1), pages_n, axis=0, mode="clip")
    return rows.reshape(pages_n.shape + pool.shape[1:])
