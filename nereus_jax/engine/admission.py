"""Admission control for a paged engine: the driver's host copy of the page pool and the policy that says
which waiting sequence may start and which live one to preempt.

The copy is exact: the device takes a page when a slot's next position starts one and gives a slot's pages
back when it finishes, so counting lengths on the host gives the device's counts without reading them.

Two policies (``Generator(..., admission=...)``):

- ``"reserve"``: a sequence starts only when the pool can hold it to its token limit, counting what the live
  sequences may still grow to (prompt + limit - 1 positions each). Nothing is ever preempted; with limits near
  the real lengths (forced lengths, per-request limits) it packs the pool, with one large limit for every
  request it holds no more sequences than the unpaged engine.
- ``"preempt"`` (vLLM's policy): a sequence starts when the pool holds its prompt plus what every live
  sequence needs for the next engine call, with a page to spare per live sequence (a watermark: fewer
  admissions that a preemption soon undoes); sequences grow page by page, and when the next call needs more
  pages than are free, the most recently admitted live sequence is preempted: its pages are copied to host
  memory (:meth:`JaxEngine.evict`) and freed. Preempted sequences resume first, oldest first, when the pool
  can hold them again, into fresh pages with the same contents (:meth:`JaxEngine.resume`), so their tokens
  and log-probabilities are those of an uninterrupted run. (Recomputing the cache with a prefill instead, as
  vLLM v1 does, would round differently from the decode steps that built it.) The oldest live sequence is
  never preempted while another is live, so every admitted sequence finishes.

Under either policy a request that could not fit the pool even alone (prompt + limit - 1 positions) is
refused when ``generate`` is called, before anything runs.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

Admission = Literal["reserve", "preempt"]
POLICIES = ("reserve", "preempt")


class PagePool:
    """Per slot: tokens in cache, tokens generated, token limit, pages held; the free page count."""

    def __init__(self, slots: int, page_size: int, kv_pages: int, steps_per_call: int, policy: Admission):
        self.page_size, self.total, self.k, self.policy = page_size, kv_pages, steps_per_call, policy
        self.free = kv_pages
        self.held = np.zeros(slots, np.int64)
        self.length = np.zeros(slots, np.int64)
        self.steps = np.zeros(slots, np.int64)
        self.limit = np.zeros(slots, np.int64)
        self.live = np.zeros(slots, bool)
        self.peak_used = 0

    def pages(self, positions) -> np.ndarray:
        return -(-np.asarray(positions, np.int64) // self.page_size)

    # ------------------------------------------------------------------------------------- questions
    def most_pages(self, length, steps, limit) -> np.ndarray:
        """Pages a sequence holds at its end: it writes one position per token it still feeds."""
        return self.pages(np.asarray(length) + np.asarray(limit) - np.asarray(steps))

    def next_pages(self, length, steps, limit) -> np.ndarray:
        """Pages a sequence holds after the next engine call (up to k decode steps)."""
        return self.pages(np.asarray(length) + np.minimum(self.k, np.asarray(limit) - np.asarray(steps)))

    def growth(self) -> int:
        """New pages the live slots take in the next engine call."""
        grow = self.next_pages(self.length, self.steps, self.limit) - self.held
        return int(np.sum(np.where(self.live, np.maximum(grow, 0), 0)))

    def bound(self) -> int:
        """Pages the next engine call reads at most (its last step, every live slot)."""
        return int(np.sum(np.where(self.live, self.next_pages(self.length, self.steps, self.limit), 0)))

    def fits(self, length: int, steps: int, limit: int) -> bool:
        """May a sequence with ``length`` tokens in cache, ``steps`` generated of ``limit`` start now?"""
        if self.policy == "reserve":
            owed = np.where(self.live, self.most_pages(self.length, self.steps, self.limit) - self.held, 0)
            return int(self.most_pages(length, steps, limit)) <= self.free - int(np.sum(owed))
        headroom = int(np.sum(self.live))  # a page per live sequence: fewer admissions undone by preemption
        return int(self.next_pages(length, steps, limit)) <= self.free - self.growth() - headroom

    # -------------------------------------------------------------------------------------- changes
    def start(self, slot: int, length: int, steps: int, limit: int, held: int | None = None) -> None:
        """A sequence enters ``slot`` (inserted from a prefix, or resumed holding ``held`` pages)."""
        held = int(self.pages(length)) if held is None else held
        assert held <= self.free, "admitted a sequence the pool cannot hold"
        self.held[slot], self.length[slot], self.steps[slot], self.limit[slot] = held, length, steps, limit
        self.live[slot] = True
        self._take(held)

    def step(self, slots: np.ndarray, finished: np.ndarray) -> None:
        """One decode step of ``slots`` (each wrote one position); ``finished`` ones give their pages back."""
        now = self.pages(self.length[slots] + 1)
        self._take(int(np.sum(np.maximum(now - self.held[slots], 0))))
        self.held[slots] = np.maximum(self.held[slots], now)
        self.length[slots] += 1
        self.steps[slots] += 1
        for slot in slots[finished]:
            self.stop(slot)

    def stop(self, slot: int) -> int:
        """``slot`` ends (finished or preempted): its pages are free. Returns how many it held."""
        held = int(self.held[slot])
        self.free += held
        self.held[slot], self.live[slot] = 0, False
        return held

    def victim(self, order: np.ndarray) -> int:
        """The live slot to preempt: the most recently admitted (largest ``order``)."""
        live = np.flatnonzero(self.live)
        return int(live[np.argmax(order[live])])

    def _take(self, pages: int) -> None:
        self.free -= pages
        assert self.free >= 0, "the driver's page count went negative"
        self.peak_used = max(self.peak_used, self.total - self.free)
