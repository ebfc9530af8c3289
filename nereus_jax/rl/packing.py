"""Sequence packing: a rollout batch's real tokens laid end to end in rows, instead of one padded row each.

A padded batch runs every sequence at ``P + R`` tokens (prompt left-padded to P, response right-padded to
R, :mod:`nereus_jax.rl.batch`); on long-tailed responses most of that is padding. Packing puts several
sequences into one row of ``L = P + R`` tokens (first-fit decreasing), each its own *segment*: attention
never crosses a segment and positions restart at 0 in each, so every token sees exactly what it saw
padded. The forward runs on the packed rows; per-response-token results (log-probs, entropies, values) are
gathered back to the ``[sequence, R]`` layout with :attr:`PackedLayout.index`, so losses, normalisers and
advantages are computed exactly as for the padded batch.

Static shapes: a program's micro-batch has a fixed number of sequences per replica (as padded) and a fixed
number of packed rows. Within each mini-batch, sequences are dealt to the ``accum x dp`` (micro-batch,
replica) groups longest first in snake order (each group gets the same count and nearly the same tokens),
and each group is packed on its own, so a replica's gather never reads another replica's rows. ``accum`` is
the fewest micro-batches whose every group packs into the token budget (``micro_batch_tokens // L`` rows);
the packed row count is rounded up a sqrt(2) ladder (1, 2, 3, 4, 6, 8, 12, 16, 23, ...), so a run compiles a
handful of shapes and runs at most ~41% empty rows.

    layout = pack(tokens, mask, prompt_len=P, mini=2, dp=4, budget_rows=8)
    fields = {k: v[layout.order] for k, v in per_sequence.items()}   # the order the groups hold them in
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np


@dataclasses.dataclass(frozen=True)
class PackedLayout:
    """A batch of N sequences packed for ``mini`` mini-batches x ``accum`` micro-batches x ``dp`` replicas.

    ``order[k]``: the original row of the k-th sequence in group order (mini-batch, micro-batch, replica,
    then position in the group), the order per-sequence fields must be given in. Packed arrays are
    ``[mini, accum, dp, rows, L]``: ``tokens`` (0 on padding), ``positions`` (restarting per segment),
    ``segments`` (1, 2, ... per sequence in its row, 0 on padding) and ``source`` (the flat offset
    ``row * L + column`` in the padded batch of each packed token, -1 on padding: per-token arrays such as
    recorded routes are packed with it, :func:`pack_tokens`). ``index`` ``[N, R]`` (group order): for
    response token t of a sequence, the flat offset ``row * L + column`` within its replica's rows of the
    output at the column that predicts it (the token before it); 0 where t is past the response. ``last``
    ``[N]``: the same offset of each sequence's last real token (a reward model's score)."""

    order: np.ndarray
    accum: int
    rows: int
    tokens: np.ndarray
    positions: np.ndarray
    segments: np.ndarray
    source: np.ndarray
    index: np.ndarray
    last: np.ndarray

    @property
    def packed_tokens(self) -> int:
        """Real tokens in the packed arrays (the work packing pays for, with ``self.tokens.size`` slots)."""
        return int((self.segments > 0).sum())


def pack(tokens: np.ndarray, mask: np.ndarray, *, prompt_len: int, mini: int, dp: int, budget_rows: int,
         quantum: int | None = None) -> PackedLayout:
    """Packs ``tokens`` / ``mask`` ``[N, P + R]`` (prompt left-padded to ``prompt_len``, response right-padded)
    into rows of ``P + R`` tokens; ``budget_rows``: packed rows a replica's micro-batch may hold (the token
    budget over the row length, >= 1); ``quantum``: packed row counts are rounded up to a multiple of it
    (default a quarter of ``budget_rows``). The fewest micro-batches that fit the budget are used."""
    tokens, mask = np.asarray(tokens), np.asarray(mask)
    n, width = tokens.shape
    if n % (mini * dp):
        raise ValueError(f"{n} sequences do not split into {mini} mini-batches over dp={dp} replicas")
    lengths = mask.sum(axis=1).astype(np.int64)
    starts = np.argmax(mask > 0, axis=1)
    if (np.any(starts >= prompt_len) or np.any(starts + lengths > width)
            or np.any(mask.cumsum(axis=1)[np.arange(n), np.minimum(starts + lengths, width) - 1] != lengths)):
        raise ValueError("every row needs its real tokens in one run: a non-empty prompt left-padded to "
                         f"prompt_len={prompt_len}, then the response right-padded")
    budget_rows = max(1, budget_rows)
    per_replica = n // (mini * dp)
    for accum in (a for a in range(1, per_replica + 1) if per_replica % a == 0):  # ends at one sequence a group
        groups = _deal(lengths, mini, accum, dp)
        bins = [_first_fit(lengths[g], width) for g in groups]
        need = max(int(b.max()) + 1 for b in bins)
        if need <= budget_rows:
            break
    rows = min(budget_rows, _bucket(need) if quantum is None else math.ceil(need / quantum) * quantum)
    return _layout(tokens, mask, lengths, starts, prompt_len, groups, bins, (mini, accum, dp, rows, width))


def _bucket(need: int) -> int:
    """The smallest of 1, 2, 3, 4, 6, 8, 12, 16, 23, 32, ... (a sqrt(2) ladder) that holds ``need`` rows: at
    most ~41% empty rows, and a handful of shapes to compile over a run."""
    k = 0
    while math.ceil(2 ** (k / 2)) < need:
        k += 1
    return math.ceil(2 ** (k / 2))


def _deal(lengths: np.ndarray, mini: int, accum: int, dp: int) -> list[np.ndarray]:
    """Each mini-batch's rows (contiguous, as padded) dealt longest first, snake order, to accum x dp groups
    of equal count; groups listed in (mini-batch, micro-batch, replica) order."""
    n = len(lengths)
    per_mini, count = n // mini, accum * dp
    groups = []
    for m in range(mini):
        rows = np.arange(m * per_mini, (m + 1) * per_mini)
        rows = rows[np.argsort(-lengths[rows], kind="stable")]
        turn = np.arange(per_mini) % (2 * count)
        slot = np.where(turn < count, turn, 2 * count - 1 - turn)
        groups += [rows[slot == g] for g in range(count)]
    return groups


def _first_fit(lengths: np.ndarray, width: int) -> np.ndarray:
    """First-fit decreasing into rows of ``width``: the packed row of each sequence (in ``lengths`` order)."""
    row = np.zeros(len(lengths), np.int64)
    free: list[int] = []
    for i in np.argsort(-lengths, kind="stable"):
        fit = next((r for r, space in enumerate(free) if space >= lengths[i]), None)
        if fit is None:
            fit = len(free)
            free.append(width)
        free[fit] -= int(lengths[i])
        row[i] = fit
    return row


def _layout(tokens, mask, lengths, starts, prompt_len, groups, bins, shape) -> PackedLayout:
    mini, accum, dp, rows, width = shape
    response = width - prompt_len
    packed = np.zeros(shape, tokens.dtype)
    positions = np.zeros(shape, np.int32)
    segments = np.zeros(shape, np.int32)
    source = np.full(shape, -1, np.int64)
    index = np.zeros((len(tokens), response), np.int32)
    last = np.zeros(len(tokens), np.int32)
    t = np.arange(response)
    k = 0
    for g, (members, row_of) in enumerate(zip(groups, bins, strict=True)):
        m, a, d = np.unravel_index(g, (mini, accum, dp))
        fill, count = np.zeros(rows, np.int64), np.zeros(rows, np.int32)
        for seq, r in zip(members, row_of, strict=True):
            off, size, s = int(fill[r]), int(lengths[seq]), int(starts[seq])
            fill[r] += size
            count[r] += 1
            packed[m, a, d, r, off:off + size] = tokens[seq, s:s + size]
            positions[m, a, d, r, off:off + size] = np.arange(size)
            segments[m, a, d, r, off:off + size] = count[r]
            source[m, a, d, r, off:off + size] = seq * width + s + np.arange(size)
            # response token t sits at column prompt_len + t of the padded row, off + prompt_len + t - s here
            column = off + prompt_len + t - s - 1
            real = mask[seq, prompt_len:] > 0
            index[k] = np.where(real, r * width + column, 0)
            last[k] = r * width + off + size - 1
            k += 1
    order = np.concatenate(groups)
    return PackedLayout(order, accum, rows, packed, positions, segments, source, index, last)


def pack_tokens(layout: PackedLayout, x: np.ndarray, fill) -> np.ndarray:
    """A per-token array ``x`` ``[N, P + R, ...]`` of the padded batch laid out like the packed tokens,
    ``[mini, accum, dp, rows, L, ...]``, ``fill`` on padding."""
    flat = np.asarray(x).reshape(-1, *np.shape(x)[2:])
    out = flat[np.maximum(layout.source, 0)]
    out[layout.source < 0] = fill
    return out
