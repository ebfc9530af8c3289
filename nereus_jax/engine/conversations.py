"""Multi-turn sequences on one :class:`~nereus_jax.engine.driver.Generator`: conversations whose turns are
generated with continuous batching while their other turns wait for answers from outside (a tool, a user).

    convs = Conversations(gen, prompts, SamplingParams(temperature=1.0, n=2, max_new_tokens=256))
    convs.run(on_turn)              # in the engine's thread; returns when every conversation is closed
    # on_turn(turn) runs in that thread when a conversation's turn ends (a stop token or its limit); then,
    # from any thread:
    convs.answer(turn.conversation, tokens, limit=64, prompt_id=7)   # its next turn: after these tokens
    convs.close(turn.conversation)                                  # or: it is over

Conversation ``c`` is row ``prompt * n + sample`` of the first turn (the n samples of a prompt share one
prefill). An answer's tokens follow the turn's last drawn token; the next turn draws up to ``limit`` tokens
as request ``prompt_id`` (sample 0) of the random stream, so it draws what a fresh ``Generator.rollouts`` of
the whole conversation with that id draws.

While a conversation waits for its answer no slot decodes it, and the others (and new conversations) go on.
With ``park=True`` (contiguous KV caches) its cache stays in its slot meanwhile: the answer's tokens, with
the last drawn one first, are prefilled onto it in that slot (:meth:`JaxEngine.prefill_slots`, one call for
all conversations answered since the last decode step). When a waiting conversation needs a slot and none
is free, a parked conversation is evicted (the one with the shortest cache, among those parked for at least
``PATIENCE_STEPS`` decode steps while others decode): its cache is copied to host
memory (:meth:`JaxEngine.take_cache`; copies of at most ``max_saved_bytes`` in all, by default the decode
state's own KV bytes) and put back into a free slot when its answer comes (:meth:`JaxEngine.put_cache`), or,
beyond that, dropped, and its next turn prefills the whole conversation again. With ``park=False`` (and on
paged engines) every turn after the first prefills the whole conversation. The tokens are the same whichever
way a turn starts and whatever the schedule (greedy or sampled); log-probabilities agree to float rounding
(kept keys and values were computed a decode step at a time, and prefills of different row counts round
differently).
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import numpy as np

from nereus_jax.engine.driver import Generator, RunState, prompt_id_array
from nereus_jax.engine.engine import EngineError
from nereus_jax.engine.sampling import SamplingParams

# Decode steps a just-parked conversation keeps its slot while others decode: a fast tool's answer is usually
# back by then, and evicting it would copy its cache out and back in for nothing.
PATIENCE_STEPS = 2


class Turn(NamedTuple):
    """One finished turn of conversation ``conversation``: its drawn tokens and their log-probabilities and
    parameter versions, and why it ended ("stop" or "length")."""

    conversation: int
    tokens: np.ndarray  # [m] int32
    logprobs: np.ndarray  # [m] float32
    versions: np.ndarray  # [m] int32
    finish: str


class Conversations:
    """The conversations of one engine (see the module docstring). ``answer`` / ``close`` / ``fail`` may be
    called from any thread; ``run`` once, in the thread that owns the generator."""

    def __init__(self, gen: Generator, prompts: Sequence[Sequence[int]], sampling: SamplingParams, *,
                 prompt_ids: Sequence[int] | None = None, max_new_tokens_per_prompt: Sequence[int] | None = None,
                 park: bool = True, max_saved_bytes: int | None = None):
        if gen.engine.record_routes:
            raise EngineError("conversations do not record routes yet (a turn's routes would overwrite the last's): "
                              "build the engine without record_routes")
        if park and gen.engine.paged:
            raise EngineError("park=True keeps caches in their slots: it needs a contiguous KV cache (an engine "
                              "built without page_size)")
        prompts = [np.asarray(p, np.int32).reshape(-1) for p in prompts]
        limits = gen._limits(prompts, sampling, None, max_new_tokens_per_prompt)
        saved = gen.engine.kv_cache_bytes if max_saved_bytes is None else max_saved_bytes
        self._run = _Session(gen, prompts, sampling, limits, park, saved)
        self._run.prompt_ids = prompt_id_array(prompt_ids, len(prompts))
        self.gen = gen

    @property
    def count(self) -> int:
        """Conversations: prompts x n."""
        return self._run.lengths.shape[0]

    def run(self, on_turn: Callable[[Turn], None]) -> collections.Counter:
        """Generates every turn until every conversation is closed; ``on_turn`` gets each finished turn.
        Returns the run's statistics (decode steps, prefill calls, ``turns``, ``continued`` (turns prefilled
        onto a parked cache), ``evicted`` (parked conversations that lost their slot), ``saved`` (of them, copied
        to host memory), ``restored`` (put back), ``seconds``, and its wall seconds spent decoding (with the turns'
        hand-over), prefilling and inserting, and waiting for answers: ``decode_seconds``,
        ``prefill_seconds``, ``wait_seconds``)."""
        self._run.on_turn = on_turn
        seconds = self.gen._drive(self._run, None)
        return collections.Counter({**self._run.stats, "seconds": seconds})  # a missing count reads 0

    def answer(self, conversation: int, tokens: Sequence[int], *, limit: int, prompt_id: int) -> None:
        """Conversation ``conversation``'s next turn: ``tokens`` (maybe none) follow its last turn, then up to
        ``limit`` tokens are drawn as request ``prompt_id``."""
        self._run.post(("answer", conversation, np.asarray(tokens, np.int32).reshape(-1), int(limit),
                        int(prompt_id)))

    def close(self, conversation: int) -> None:
        """Conversation ``conversation`` has no more turns (its slot, if it kept one, is free)."""
        self._run.post(("close", conversation))

    def fail(self, error: BaseException) -> None:
        """Stops ``run``, which raises ``error`` (an answer that cannot come)."""
        self._run.post(("fail", error))


class _Session(RunState):
    """:class:`RunState` with requests arriving while it runs: each conversation's next turn is a new request (a
    prompt of one sample) answered by the conversation's row."""

    def __init__(self, gen: Generator, prompts, sampling: SamplingParams, limits, park: bool, max_saved_bytes: int):
        super().__init__(gen, prompts, sampling, limits, forced=False, refill="continuous")
        n, rows = sampling.n, self.lengths.shape[0]
        self.park, self.initial = park, len(prompts)
        self.on_turn: Callable[[Turn], None] | None = None
        self.history = [list(map(int, prompts[r // n])) for r in range(rows)]  # every token so far
        self.open = rows
        self.slot_kept = np.full(self.engine.max_concurrent_decodes, -1, np.int64)  # conversation parked there
        self.parked_at = np.zeros(self.engine.max_concurrent_decodes, np.int64)  # decode steps then
        self.kept_slot = np.full(rows, -1, np.int64)
        self.continuing: list[tuple[int, int]] = []  # (request, slot): answered, its cache in its slot
        self.cached = np.zeros(rows, np.int64)  # a parked conversation's tokens in cache (all but its last)
        self.saved: dict[int, tuple] = {}  # conversation -> (host copy of its evicted cache, cached tokens)
        self.max_saved_bytes, self.saved_bytes = max_saved_bytes, 0
        self.restoring: collections.deque = collections.deque()  # answered requests whose cache is saved
        self._inbox: collections.deque = collections.deque()
        self._cond = threading.Condition()

    def post(self, item: tuple) -> None:
        with self._cond:
            self._inbox.append(item)
            self._cond.notify()

    # ------------------------------------------------------------------------------------- the loop
    def loop(self, on_step) -> None:
        clock = time.perf_counter()

        def spent(phase: str) -> None:  # wall seconds by phase (each ends with a read of its results)
            nonlocal clock
            now = time.perf_counter()
            self.stats[phase] += now - clock
            clock = now

        while True:
            self._swap_params()
            self._take_answers(wait=not self._has_work())
            spent("wait_seconds")
            self._continue_kept()
            if self.restoring:
                self._restore()
                self._continue_kept()
            self._fill_slots()
            spent("prefill_seconds")
            if not np.any(self.slot_row >= 0):
                if not self.open:
                    assert not self.waiting and not self.ready and not self.parked and not self.restoring
                    return
                continue  # every open conversation waits for its answer
            pages = self._make_room()
            if self.engine.decode_steps_per_call > 1:
                self._decode_chunk(pages)
            else:
                self.gen._state, result = self.engine.generate(self.gen._params, self.gen._state, **pages)
                self._record(*jax.device_get((result.tokens, result.logprobs, result.valid, result.done)))
                self.stats["decode_steps"] += 1
            spent("decode_seconds")

    def _has_work(self) -> bool:
        return bool(np.any(self.slot_row >= 0) or self.waiting or self.ready or self.parked or self.restoring
                    or not self.open)

    def _take_answers(self, wait: bool) -> None:
        with self._cond:
            while wait and not self._inbox:
                self._cond.wait()
            items, self._inbox = list(self._inbox), collections.deque()
        for kind, *args in items:
            if kind == "fail":
                raise args[0]
            if kind == "close":
                self._close(*args)
            else:
                self._next_turn(*args)

    def _close(self, row: int) -> None:
        if self.kept_slot[row] >= 0:
            self.slot_kept[self.kept_slot[row]] = -1
            self.kept_slot[row] = -1
        self._unsave(row)
        self.open -= 1

    def _next_turn(self, row: int, tokens: np.ndarray, limit: int, prompt_id: int) -> None:
        """Conversation ``row``'s next turn as a new request: onto its parked cache (in its slot, or put back
        from its saved copy) when it kept one that can take the tokens, else the whole conversation prefilled
        again."""
        e = self.engine
        if not 1 <= limit <= self.sampling.max_new_tokens:
            raise EngineError(f"conversation {row}: an answer's limit must be in [1, {self.sampling.max_new_tokens}]"
                              f", got {limit}")
        self.history[row] += tokens.tolist()
        total = len(self.history[row])
        if total + limit > e.max_target_length:
            raise EngineError(f"conversation {row}: {total} tokens + {limit} new exceed max_target_length="
                              f"{e.max_target_length}")
        if e.paged and e.pages_for(total + limit - 1) > e.kv_pages:
            raise EngineError(f"conversation {row}: {total} tokens + {limit} new need more KV pages than the pool's "
                              f"kv_pages={e.kv_pages}")
        slot, cached = int(self.kept_slot[row]), int(self.cached[row])
        fits = total - cached <= e.max_prefill_length  # the new tokens, with the last one it drew
        if slot >= 0 and not fits:
            self._evict(slot, save=False)
        if not fits:
            self._unsave(row)
        onto, restore = slot >= 0 and fits, row in self.saved
        if not (onto or restore) and total > e.max_prompt_length:
            raise EngineError(f"conversation {row}: {total} tokens to prefill again exceed max_prompt_length="
                              f"{e.max_prompt_length}")
        request = len(self.prompts)
        self.prompts.append(np.asarray(self.history[row][cached:] if onto or restore else self.history[row], np.int32))
        self.limits = np.append(self.limits, np.int32(limit))
        self.prompt_ids = np.append(self.prompt_ids, prompt_id)
        self.first_row, self.samples = np.append(self.first_row, row), np.append(self.samples, 1)
        self.row_prompt[row], self.lengths[row], self.finish[row] = request, 0, ""
        if onto:
            self.continuing.append((request, slot))
        elif restore:
            self.restoring.append(request)
        else:
            self.waiting.append(request)

    # ------------------------------------------------------------------------------------- slots
    def _continue_kept(self) -> None:
        """Prefills every answered parked conversation onto its slot's cache, up to a prefill batch a call."""
        while self.continuing:
            batch, self.continuing = (self.continuing[:self.engine.max_prefill_batch],
                                      self.continuing[self.engine.max_prefill_batch:])
            requests, slots = (list(x) for x in zip(*batch, strict=True))
            prompts = [self.prompts[q] for q in requests]
            t = max(p.size for p in prompts)
            tokens = np.stack([np.pad(p, (0, t - p.size)) for p in prompts])
            self.gen._state, first = self.engine.prefill_slots(self.gen._params, self.gen._state, slots, tokens,
                                                               [p.size for p in prompts], self._requests(requests))
            first_tokens, first_logprobs = jax.device_get((first.tokens, first.logprobs))
            self.stats["prefill_slots_calls"] += 1
            self.stats["prefill_tokens"] += sum(p.size for p in prompts)
            for k, (request, slot) in enumerate(batch):
                row = int(self.first_row[request])
                self.slot_kept[slot], self.kept_slot[row] = -1, -1
                self.stats["continued"] += 1
                if self._append(row, first_tokens[k, 0], first_logprobs[k, 0], self.gen.version):
                    self._finished(row, slot)  # ended at once: its cache stays in the slot
                else:
                    self.slot_row[slot] = row
                    self.order[slot], self.admitted = self.admitted, self.admitted + 1

    def _padded(self, take: list[int]) -> list[int]:
        """First turns as :meth:`Generator.rollouts` prefills them (full batches: the same numbers); later
        turns come a few at a time, so their rows are only padded to their bucket (by the engine)."""
        return super()._padded(take) if take[0] < self.initial else take

    def _restore(self) -> None:
        """Answered conversations whose caches were saved go back into free slots (first), to be continued."""
        free = self._free_slots()
        while self.restoring and free:
            request, slot = self.restoring.popleft(), int(free.pop(0))
            row = int(self.first_row[request])
            caches, length = self.saved[row]
            self._unsave(row)
            self.gen._state = self.engine.put_cache(self.gen._state, slot, caches, length)
            self.slot_kept[slot], self.kept_slot[row] = row, slot
            self.continuing.append((request, slot))
            self.stats["restored"] += 1

    def _free_slots(self) -> list:
        free = list(np.flatnonzero((self.slot_row < 0) & (self.slot_kept < 0)))
        need = len(self.restoring) + len(self.ready) + int(sum(self.samples[q] for q in self.waiting)) - len(free)
        kept = np.flatnonzero(self.slot_kept >= 0)
        if np.any(self.slot_row >= 0):  # while others decode, a conversation parked just now keeps its slot
            kept = kept[self.stats["decode_steps"] - self.parked_at[kept] >= PATIENCE_STEPS]
        while need > 0 and kept.size:  # a waiting conversation takes a parked one's slot
            slot = int(kept[np.argmin([len(self.history[self.slot_kept[s]]) for s in kept])])
            kept = kept[kept != slot]
            self._evict(slot)
            free.append(slot)
            need -= 1
        return free

    def _evict(self, slot: int, save: bool = True) -> None:
        """Slot ``slot``'s parked conversation leaves it: its cache copied to host memory while the copies fit
        ``max_saved_bytes`` (put back when its answer comes), else dropped (its next turn prefills it all)."""
        row = int(self.slot_kept[slot])
        cached = int(self.cached[row])
        size = self.engine.kv_page_bytes * self.engine.cache_width(cached)  # bytes of one position, all layers
        if save and self.saved_bytes + size <= self.max_saved_bytes:
            self.saved[row] = (jax.device_get(self.engine.take_cache(self.gen._state, slot, cached)), cached)
            self.saved_bytes += size
            self.stats["saved"] += 1
        self.kept_slot[row] = -1
        self.slot_kept[slot] = -1
        self.stats["evicted"] += 1

    def _unsave(self, row: int) -> None:
        if row in self.saved:
            caches, _ = self.saved.pop(row)
            self.saved_bytes -= sum(x.nbytes for kv in caches for x in kv)

    def _finished(self, row: int, slot: int | None) -> None:
        """A turn ended: its tokens join the conversation, which parks in ``slot`` (when it had one and
        ``park``) until its answer, and ``on_turn`` hears of it."""
        m = int(self.lengths[row])
        self.history[row] += self.tokens[row, :m].tolist()
        if self.park and slot is not None:
            self.slot_kept[slot], self.kept_slot[row] = row, slot
            self.cached[row] = len(self.history[row]) - 1
            self.parked_at[slot] = self.stats["decode_steps"]
        self.stats["turns"] += 1
        self.on_turn(Turn(row, self.tokens[row, :m].copy(), self.logprobs[row, :m].copy(),
                          self.versions[row, :m].copy(), self.finish[row]))
