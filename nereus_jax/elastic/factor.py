"""How one replica's devices split into replicas of a smaller layout (the paper's Split, read backwards: Merge).

A replica of layout ``(tp, pp, ep)`` on devices ``D`` (position ``(p * ep + e) * tp + t``, the order of
``make_mesh``) splits into ``k = (tp / tp') * (pp / pp') * (ep / ep')`` replicas of ``(tp', pp', ep')``. Along
each axis the sub-replicas take ranks either *strided* (rank ``r' * k + j`` goes to sub-replica ``j`` as its rank
``r'``: every device keeps part of what it had, so a Split is one all-gather and a Merge a local slice) or
*blocked* (rank ``j * n' + r'``: sub-replica ``j`` is a contiguous block of ranks). Both keep the flat device
order of the big replica, so one jitted program covers the big and the small layout on the same device list,
which ``jax.jit`` requires.

Modes are ``(pp mode, tp mode)``, and ``(pp mode, tp mode, ep mode)`` when the big layout has ep > 1 (so dense
layouts keep their two-mode form). A factored mesh has axes ``pp``/``rp``, ``expert``/``re`` (ep > 1 only) and
``tp``/``rt``: each mesh axis of the small layout and the sub-replica index along it.

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
Modes = tuple[str, ...]  # (pp mode, tp mode[, ep mode])
FACTOR_AXES = ("pp", "rp", "expert", "re", "tp", "rt")


def common_layout(a: Layout, b: Layout) -> Layout:
    """The largest layout both ``a`` and ``b`` split into."""
    return Layout(tp=math.gcd(a.tp, b.tp), pp=math.gcd(a.pp, b.pp), ep=math.gcd(a.ep, b.ep))


def _options(big: int, small: int) -> list[str]:
    return [STRIDED, BLOCKED] if big > small > 1 else [STRIDED]


@functools.lru_cache(maxsize=1024)
def mode_options(big: Layout, small: Layout) -> list[Modes]:
    """The distinct ways ``big`` splits into ``small`` (an axis that does not split, or splits into
    single ranks, has one way). Cached: do not mutate the list."""
    pp, tp = _options(big.pp, small.pp), _options(big.tp, small.tp)
    if big.ep == 1:
        return [(a, b) for a in pp for b in tp]
    return [(a, b, c) for a in pp for b in tp for c in _options(big.ep, small.ep)]


def _ep_mode(modes: Modes) -> str:
    return modes[2] if len(modes) > 2 else STRIDED


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
    assert big.tp % small.tp == 0 and big.pp % small.pp == 0 and big.ep % small.ep == 0, (big, small)
    _, _, p_ranks = _axis(small.pp, big.pp // small.pp, modes[0])
    _, _, e_ranks = _axis(small.ep, big.ep // small.ep, _ep_mode(modes))
    _, _, t_ranks = _axis(small.tp, big.tp // small.tp, modes[1])
    return tuple(tuple((p * big.ep + e) * big.tp + t for p in ps for e in es for t in ts)
                 for ps in p_ranks for es in e_ranks for ts in t_ranks)


def factor_mesh_devices(devices: Sequence[T], big: Layout, small: Layout, modes: Modes) -> tuple[np.ndarray, tuple]:
    """``devices`` (flat order kept) reshaped to a mesh whose ``pp``/``tp`` (and with ep > 1 ``expert``) axes
    are the small layout's and ``rp``/``rt`` (``re``) index the sub-replica; returns (device array, axis names)."""
    p_sizes, p_names, _ = _axis(small.pp, big.pp // small.pp, modes[0])
    t_sizes, t_names, _ = _axis(small.tp, big.tp // small.tp, modes[1])
    names = tuple({"small": "pp", "rep": "rp"}[n] for n in p_names)
    sizes = p_sizes
    if big.ep > 1:
        e_sizes, e_names, _ = _axis(small.ep, big.ep // small.ep, _ep_mode(modes))
        names += tuple({"small": "expert", "rep": "re"}[n] for n in e_names)
        sizes += e_sizes
    names += tuple({"small": "tp", "rep": "rt"}[n] for n in t_names)
    arr = np.empty(len(devices), dtype=object)
    arr[:] = list(devices)
    return arr.reshape(sizes + t_sizes), names
