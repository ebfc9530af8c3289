"""The devices a job may use while ``cluster.schedule`` changes them (joins, leaves with or without notice)
and devices fail: the pool the controller plans on at each step boundary."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any


class DevicePool:
    """Device ids in use now; ``schedule`` is the config's ``cluster.schedule`` (entries with ``step``,
    ``leave``, ``join`` and ``notice``)."""

    def __init__(self, devices: Iterable[int], schedule: Sequence[Any] = (), log: Callable[[str], None] = print):
        self.devices: tuple[int, ...] = tuple(sorted(devices))
        self.schedule, self.log = tuple(schedule), log

    def apply(self, step: int) -> set[int]:
        """Applies the changes taking effect at ``step``; returns the devices that leave now."""
        gone: set[int] = set()
        pool = set(self.devices)
        for change in self.schedule:
            if change.step == step:
                gone |= set(change.leave) & pool
                pool = (pool - set(change.leave)) | set(change.join)
                self.log(f"step {step}: device pool change: leave {list(change.leave)} join {list(change.join)} "
                         f"-> {len(pool)} devices")
        self.devices = tuple(sorted(pool))
        return gone

    def planning(self, step: int) -> tuple[int, ...]:
        """The pool minus devices whose leave has been announced (notice) but not yet happened: a plan made
        now must not count on them."""
        leaving = {d for c in self.schedule if c.step - c.notice <= step < c.step for d in c.leave}
        return tuple(d for d in self.devices if d not in leaving)

    def remove(self, lost: Iterable[int]) -> None:
        """Failed devices leave the pool for good."""
        gone = set(lost)
        self.devices = tuple(d for d in self.devices if d not in gone)
