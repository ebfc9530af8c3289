"""How one replica's devices split into replicas of a smaller layout (the paper's Split, read backwards: Merge).

A replica of layout ``(tp, pp)`` on devices ``D`` (position ``p * tp + t``) splits into ``k = (tp / tp') *
(pp / pp')`` replicas of ``(tp', pp')``. Along each axis the sub-replicas take ranks either *strided*
(rank ``r' * k + j`` goes to sub-replica ``j`` as its rank ``r'``: every device keeps part of what it had,
so a Split is one all-gather and a Merge a local slice) or *blocked* (rank ``j * n' + r'``: sub-replica
``j`` is a contiguous block of ranks). Both keep the flat device order of the big replica, so one jitted
program covers the big and the small layout on the same device list, which ``jax.jit`` requires.

Pure metadata: devices can be ids or ``jax.Device`` objects.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import TypeVar

import numpy as np

from nereus_jax.layout import Layout

T = TypeVar("T")
STRIDED, BLOCKED = "strided", "blocked"
Modes = tuple[str, str]  # (pp mode, tp mode)
FACTOR_AXES = ("pp", "rp", "tp", "rt")


def common_layout(a: Layout, b: Layout) -> Layout:
    """The largest layout both ``a`` and ``b`` split into."""
    return Layout(tp=math.gcd(a.tp, b.tp), pp=math.gcd(a.pp, b.pp))


@functools.lru_cache(maxsize=1024)
def mode_options(big: Layout, small: Layout) -> list[Modes]:
    """The distinct ways ``big`` splits into ``small`` (an axis that does not split, or splits into
    single ranks, has one way). Cached: do not mutate the list."""
    pp = [STRIDED, BLOCKED] if big.pp > small.pp > 1 else [STRIDED]
    tp = [STRIDED, BLOCKED] if big.tp > small.tp > 1 else [STRIDED]
    return [(a, b) for a in pp for b in tp]


def _axis(n_small: int, k: int, mode: str) -> tuple[tuple[int, int], tuple[str, str], list[list[int]]]:
    """Sizes and names of the two factor axes for one mesh axis, and rank lists per sub-replica."""
    if mode == STRIDED:
        ranks = [[r * k + j for r in range(n_small)] for j in range(k)]
        return (n_small, k), ("small", "rep"), ranks
    ranks = [[j * n_small + r for r in range(n_small)] for j in range(k)]
    return (k, n_small), ("rep", "small"), ranks


def sub_replicas(devices: Sequence[T], big: Layout, small: Layout, modes: Modes) -> list[tuple[T, ...]]:
    """The ``k`` sub-replicas (ordered device tuples of layout ``small``) of a ``big`` replica."""
    return [tuple(devices[i] for i in pos) for pos in _positions(big, small, modes)]


@functools.lru_cache(maxsize=1024)
def _positions(big: Layout, small: Layout, modes: Modes) -> tuple[tuple[int, ...], ...]:
    """Per sub-replica, the positions (in the big replica's device tuple) of its devices, in order."""
    assert big.tp % small.tp == 0 and big.pp % small.pp == 0, (big, small)
    kp, kt = big.pp // small.pp, big.tp // small.tp
    _, _, p_ranks = _axis(small.pp, kp, modes[0])
    _, _, t_ranks = _axis(small.tp, kt, modes[1])
    return tuple(tuple(p * big.tp + t for p in ps for t in ts) for ps in p_ranks for ts in t_ranks)


def factor_mesh_devices(devices: Sequence[T], big: Layout, small: Layout, modes: Modes) -> tuple[np.ndarray, tuple]:
    """``devices`` (flat order kept) reshaped to a 4-axis mesh whose ``pp``/``tp`` axes are the small
    layout's and ``rp``/``rt`` index the sub-replica; returns (device array, axis names)."""
    kp, kt = big.pp // small.pp, big.tp // small.tp
    p_sizes, p_names, _ = _axis(small.pp, kp, modes[0])
    t_sizes, t_names, _ = _axis(small.tp, kt, modes[1])
    names = tuple({"small": "pp", "rep": "rp"}[n] for n in p_names) + tuple(
        {"small": "tp", "rep": "rt"}[n] for n in t_names)
    arr = np.empty(len(devices), dtype=object)
    arr[:] = list(devices)
    return arr.reshape(p_sizes + t_sizes), names
