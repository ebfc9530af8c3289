"""The memory ledger: bytes per device of every live array, from shardings, under per-device caps.

CPU devices report no memory statistics, so the transition machinery keeps its own account: a key per
device memory (the device id ``d``) and per pinned host memory beside a device (``~d``, i.e. ``-d - 1``).
Caps bound each device's memory (``ClusterConfig.device_memory_bytes``) and, optionally, all pinned host
memory together. The ledger tracks peaks per key and of the device total. It imports no JAX: what arrays
really hold, and on GPU ``device.memory_stats()``, are read by ``elastic.measured``.

    ledger = Ledger(caps=2 * 2**30)
    ledger.acquire({0: n, 1: n}, "extend actor-gen")   # raises CapExceeded naming device and bytes short
    ledger.release({0: n, 1: n})
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from nereus_jax.config import ClusterConfig

from .plan import DEVICE


class CapExceeded(RuntimeError):
    """An acquisition that would push a device (or host memory) past its cap."""


def key(device_id: int, memory: str = DEVICE) -> int:
    """The ledger key of a device's memory (``d``) or the pinned host memory beside it (``~d``)."""
    return device_id if memory == DEVICE else ~device_id


def describe_key(k: int) -> str:
    return f"device {k}" if k >= 0 else f"pinned host memory of device {~k}"


def fmt_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    sign, n = ("-" if n < 0 else ""), abs(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


class Ledger:
    """Live bytes per key with caps and peaks. ``caps``: one cap for every device, a mapping device id ->
    cap, or None (uncapped); ``host_cap``: all pinned host memory together (None = uncapped)."""

    def __init__(self, caps: int | Mapping[int, int] | None = None, host_cap: int | None = None,
                 initial: Mapping[int, int] | None = None):
        self.default_cap = caps if isinstance(caps, int) else None
        self.caps = dict(caps) if isinstance(caps, Mapping) else {}
        self.host_cap = host_cap
        self.used: dict[int, int] = {}
        self.peak: dict[int, int] = {}
        self.total = self.host_total = self.peak_total = 0
        if initial:
            self.acquire(initial, "initial state", check=False)

    @classmethod
    def from_config(cls, cluster: ClusterConfig, host_cap: int | None = None) -> Ledger:
        return cls(cluster.device_memory_bytes, host_cap)

    def cap(self, k: int) -> float:
        if k < 0:
            return math.inf
        c = self.caps.get(k, self.default_cap) if self.caps else self.default_cap
        return math.inf if c is None else c

    def shortfall(self, delta: Mapping[int, int]) -> tuple[int, int] | None:
        """(key, bytes short) of the first key ``delta`` would push past its cap, else None."""
        used, uniform = self.used, None if self.caps else self.default_cap
        for k, n in delta.items():
            cap = (math.inf if k < 0 else uniform) if uniform is not None else self.cap(k)
            over = used.get(k, 0) + n - cap
            if n > 0 and over > 0:
                return k, int(over)
        if self.host_cap is not None:
            host = sum(n for k, n in delta.items() if k < 0)
            if host > 0 and self.host_total + host > self.host_cap:
                return min(k for k in delta if k < 0), int(self.host_total + host - self.host_cap)
        return None

    def acquire(self, delta: Mapping[int, int], label: str = "", *, check: bool = True) -> None:
        """Counts new bytes; raises CapExceeded (naming the key and bytes short) before counting any."""
        if check and (short := self.shortfall(delta)) is not None:
            k, n = short
            raise CapExceeded(f"{label}: {describe_key(k)} would exceed its cap by {fmt_bytes(n)} "
                              f"({fmt_bytes(self.used.get(k, 0))} in use, cap {fmt_bytes(self.cap(k))})")
        in_use, peak = self.used, self.peak
        for k, n in delta.items():
            used = in_use.get(k, 0) + n
            in_use[k] = used
            if used > peak.get(k, 0):
                peak[k] = used
            if k >= 0:
                self.total += n
            else:
                self.host_total += n
        if self.total > self.peak_total:
            self.peak_total = self.total

    def release(self, delta: Mapping[int, int]) -> None:
        in_use = self.used
        for k, n in delta.items():
            left = in_use[k] - n
            assert left >= 0, f"{describe_key(k)}: released more than was acquired"
            in_use[k] = left
            if k >= 0:
                self.total -= n
            else:
                self.host_total -= n

    def max_peak(self) -> int:
        return max((n for k, n in self.peak.items() if k >= 0), default=0)

    def __repr__(self) -> str:
        rows = ", ".join(f"{describe_key(k)}: {fmt_bytes(n)}" for k, n in sorted(self.used.items()) if n)
        return f"Ledger({rows}; peak total {fmt_bytes(self.peak_total)})"
