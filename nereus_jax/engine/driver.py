"""The rollout driver the RL job calls: ``Generator.rollouts(prompts, sampling)`` over a :class:`JaxEngine`.

Continuous batching: a slot whose sequence ends is refilled with the next waiting sample before the next
decode step. The n samples of a prompt share one prefill (one KV cache copied into n slots, n first
tokens drawn from the same logits), and the samples of one prefill that get slots go in with one
``insert_many`` call. Prompts are prefilled ahead in batches of up to the engine's ``max_prefill_batch``.
New parameters handed to :meth:`Generator.set_params` (from any thread) are swapped in between two
decode steps; live slots keep their caches and go on, and every token records the version of the
parameters that produced it.

    engine = JaxEngine(cfg, max_concurrent_decodes=32, max_prefill_length=64, max_target_length=192)
    gen = Generator(engine, engine.load_params(params))
    out = gen.rollouts(prompts, SamplingParams(temperature=1.0, max_new_tokens=128, n=8, seed=0))
    out.tokens[row, :out.lengths[row]]          # row = prompt * n + sample

With the engine's ``decode_steps_per_call=k > 1`` each engine call runs k decode steps (one dispatch per k
tokens); the driver consumes them in order, honouring stop tokens and token limits as with k=1 (a row's
tokens after its end are discarded on the device already), and refills slots after the call. The tokens,
log-probabilities and lengths are those of k=1 (sampling keys are per request and token index, never per
slot or step), but refills, parameter swaps and ``on_step`` happen only between calls: a swap lands up to
k-1 steps later than with k=1, so ``param_versions`` match k=1 only when no swap happens mid-generation.

Prompts longer than the engine's ``max_prefill_length`` (up to its ``max_prompt_length``) are prefilled
alone, in chunks of ``max_prefill_length`` tokens, each chunk attending to the ones before it.

``refill="static"`` refills only when every slot is done (the classic static batch, for comparison);
``forced_lengths`` makes each prompt's samples generate exactly that many tokens (stop tokens ignored).

With a paged engine (``JaxEngine(..., page_size=...)``) a free slot is not enough: a sequence starts only
when the KV pool can take it under the generator's ``admission`` policy (``"preempt"``, the default, or
``"reserve"``; ``nereus_jax.engine.admission`` says what each does), preempted sequences resume before new
ones start, and each engine call is told how many pages it reads. A request the pool could not hold even
alone is refused before anything runs. Tokens, log-probabilities and lengths do not depend on the policy,
the pool size or preemptions. ``stats`` adds ``preemptions``, ``peak_live`` (most live slots at a step),
``mean_live`` (live slots per decode step) and ``peak_pages`` (most pages in use).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import numpy as np

from nereus_jax.engine.admission import POLICIES, Admission, PagePool
from nereus_jax.engine.engine import EngineError, JaxEngine, Params
from nereus_jax.engine.sampling import SamplingParams, make_requests

Refill = Literal["continuous", "static"]


@dataclasses.dataclass(frozen=True)
class Rollouts:
    """Generated responses, one row per (prompt, sample), prompt-major: row = prompt * n + sample."""

    tokens: np.ndarray  # [rows, max_new_tokens] int32, pad_id after each row's length
    logprobs: np.ndarray  # [rows, max_new_tokens] float32: log_softmax(logits / temperature); 0 after length
    lengths: np.ndarray  # [rows] int32 tokens generated (a stop token included)
    finish_reasons: tuple[str, ...]  # per row: "stop" (drew a stop token) or "length" (hit its token limit)
    param_versions: np.ndarray  # [rows, max_new_tokens] int32 version of the params behind each token; -1 after
    prompt_index: np.ndarray  # [rows]
    sample_index: np.ndarray  # [rows]
    stats: dict[str, Any]  # decode_steps, decode_calls (k > 1), prefill_calls, prefill_tokens (real prompt
    # tokens prefilled), insert_calls, tokens, seconds,
    # thread_cpu_s (the calling thread's CPU seconds), ...
    # engines that record routes (routing replay): the router's top-k per layer, int16, -1 where none ran
    routes: np.ndarray | None = None  # [rows, max_new_tokens, layers, k] of each response token (its last: -1)
    prompt_routes: np.ndarray | None = None  # [rows, max_prompt_length, layers, k] of the prompt tokens it
    # prefilled, right-aligned (left-padded with -1, as a batch left-pads its prompts)

    @property
    def num_rows(self) -> int:
        return int(self.lengths.shape[0])


class Generator:
    """Holds an engine, its decode state and the current parameters (with their version)."""

    def __init__(self, engine: JaxEngine, params: Params, *, version: int = 0, pad_id: int = 0,
                 admission: Admission = "preempt"):
        if admission not in POLICIES:
            raise EngineError(f"admission must be one of {POLICIES}, got {admission!r}")
        self.engine, self.admission = engine, admission
        self._params, self.version = params, version
        self.pad_id = pad_id
        self._pending: tuple[Params, int] | None = None
        self._lock = threading.Lock()
        self._state = engine.init_decode_state()
        self._clean = True  # False while a rollouts call runs: one that raised leaves slots behind
        self._running = False  # a rollouts call is decoding (set_params must wait for a step boundary)
        self._run: RunState | None = None

    def progress(self) -> dict[str, int]:
        """The current (or last) rollouts call so far: decode steps, tokens generated, live slots now, live
        slots summed over the steps, preemptions. Cheap; for ``on_step`` hooks and monitoring."""
        run = self._run
        if run is None:
            return {"decode_steps": 0, "tokens": 0, "live": 0, "slot_steps": 0, "preemptions": 0}
        return {"decode_steps": run.stats["decode_steps"], "tokens": int(run.lengths.sum()),
                "live": int(np.sum(run.slot_row >= 0)), "slot_steps": run.stats["slot_steps"],
                "preemptions": run.stats["preemptions"]}

    def set_params(self, params: Params, version: int | None = None) -> None:
        """Parameters (as ``engine.load_params`` returns them) to use from the next decode step on.
        Thread-safe; ``version`` defaults to the current one + 1. With no rollouts call running they replace
        the current ones at once, so the old parameters are freed now, not held beside the new ones until
        the next call (with a real model that is a whole second copy of the weights on the devices)."""
        with self._lock:
            pending = (params, self.version + 1 if version is None else version)
            if self._running:
                self._pending = pending
            else:
                (self._params, self.version), self._pending = pending, None

    def warm_turns(self, max_rows: int | None = None, max_tokens: int | None = None) -> None:
        """Compiles every program a conversation's later turns prefill with (:meth:`JaxEngine.warm_turns`: at most
        ``max_rows`` sequences a call, ``max_tokens`` new tokens a sequence) on this generator's parameters and
        decode state, before a run needs them; call it between runs."""
        self._state = self.engine.warm_turns(self._params, self._state, max_rows, max_tokens)

    def rollouts(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, *,
                 forced_lengths: Sequence[int] | None = None, refill: Refill = "continuous",
                 on_step: Callable[[Generator, int], None] | None = None,
                 prompt_ids: Sequence[int] | None = None,
                 max_new_tokens_per_prompt: Sequence[int] | None = None) -> Rollouts:
        """Generates ``sampling.n`` responses for every prompt (token-id sequences). ``on_step(self, step)``
        runs after every engine call with the decode steps so far (a test hook, e.g. to swap parameters at
        a known step; with ``decode_steps_per_call=k`` it runs every k steps).
        ``prompt_ids`` (default 0..len-1) are the prompts' identities in the random stream: a job that
        splits one batch over several generators passes global ids, so the split never changes samples.
        ``max_new_tokens_per_prompt`` caps each prompt's responses at its own length (each at most
        ``sampling.max_new_tokens``; stop tokens still end them), e.g. the turns of trajectories with different
        budgets left (multi-turn conversations: :class:`~nereus_jax.engine.conversations.Conversations`)."""
        if refill not in ("continuous", "static"):
            raise EngineError(f"refill must be 'continuous' or 'static', got {refill!r}")
        prompts = [np.asarray(p, np.int32).reshape(-1) for p in prompts]
        if forced_lengths is not None and max_new_tokens_per_prompt is not None:
            raise EngineError("give forced_lengths or max_new_tokens_per_prompt, not both")
        limits = self._limits(prompts, sampling, forced_lengths, max_new_tokens_per_prompt)
        run = RunState(self, prompts, sampling, limits, forced=forced_lengths is not None, refill=refill)
        run.prompt_ids = prompt_id_array(prompt_ids, len(prompts))
        return run.result(self._drive(run, on_step))

    def _drive(self, run: RunState, on_step) -> float:
        """Runs ``run``'s loop on this generator's decode state (set_params waits for step boundaries
        meanwhile); returns its seconds."""
        with self._lock:
            self._running = True
        try:
            if not self._clean:  # an earlier call stopped mid-way: start from an empty state
                self._state = self.engine.init_decode_state()
            self._run = run
            start, cpu = time.perf_counter(), time.thread_time()
            self._clean = False
            run.loop(on_step)
        finally:
            with self._lock:
                self._running = False
        self._clean = True
        run.stats["thread_cpu_s"] = time.thread_time() - cpu  # this thread's Python and dispatch seconds
        return time.perf_counter() - start

    # ------------------------------------------------------------------------------------- checking
    def _limits(self, prompts, sampling, forced_lengths, per_prompt=None) -> np.ndarray:
        e = self.engine
        if len(sampling.stop_tokens) > e.max_stop_tokens:
            raise EngineError(f"{len(sampling.stop_tokens)} stop tokens given; the engine holds at most "
                              f"max_stop_tokens={e.max_stop_tokens}")
        limits = np.full(len(prompts), sampling.max_new_tokens, np.int32)
        for name, given in (("forced_lengths", forced_lengths), ("max_new_tokens_per_prompt", per_prompt)):
            if given is None:
                continue
            limits = np.asarray(given, np.int32).reshape(-1)
            if limits.shape[0] != len(prompts) or np.any(limits < 1) or np.any(limits > sampling.max_new_tokens):
                raise EngineError(f"{name} needs one length in [1, max_new_tokens={sampling.max_new_tokens}] "
                                  f"per prompt ({len(prompts)} prompts), got {limits.shape[0]} values in "
                                  f"[{limits.min(initial=0)}, {limits.max(initial=0)}]")
        for i, (p, limit) in enumerate(zip(prompts, limits, strict=True)):
            if p.size == 0 or p.size > e.max_prompt_length:
                longest = ("max_prefill_length" if e.max_prompt_length == e.max_prefill_length else
                           "max_prompt_length")
                raise EngineError(f"prompt {i} has {p.size} tokens; prompts need 1 to {longest}="
                                  f"{e.max_prompt_length} tokens")
            if p.size + limit > e.max_target_length:
                raise EngineError(f"prompt {i} ({p.size} tokens) + {limit} new tokens exceeds max_target_length="
                                  f"{e.max_target_length}; lower max_new_tokens or build a longer engine")
            if p.size > e.max_prefill_length and e.prefill_width(p.size) > e.max_target_length:
                raise EngineError(f"prompt {i} ({p.size} tokens) is prefilled in chunks of max_prefill_length="
                                  f"{e.max_prefill_length} padded to {e.prefill_width(p.size)} positions, more than "
                                  f"max_target_length={e.max_target_length}: raise max_target_length")
            if p.min() < 0 or p.max() >= e.cfg.vocab_size:
                raise EngineError(f"prompt {i} has token ids outside the vocabulary [0, {e.cfg.vocab_size})")
            if e.paged and e.pages_for(p.size + limit - 1) > e.kv_pages:
                raise EngineError(f"prompt {i} ({p.size} tokens) + {limit} new tokens needs "
                                  f"{e.pages_for(p.size + limit - 1)} KV pages; the engine's pool has kv_pages="
                                  f"{e.kv_pages}: raise kv_pages / kv_bytes or lower max_new_tokens")
        return limits


class RunState:
    """One rollouts call: the waiting prompts, ready prefixes, slot owners and the output buffers."""

    def __init__(self, gen: Generator, prompts, sampling: SamplingParams, limits, *, forced: bool, refill: Refill):
        self.gen, self.engine, self.prompts, self.sampling = gen, gen.engine, prompts, sampling
        self.limits, self.forced, self.refill = limits, forced, refill
        n, width = sampling.n, sampling.max_new_tokens
        rows = len(prompts) * n
        self.tokens = np.full((rows, width), gen.pad_id, np.int32)
        self.logprobs = np.zeros((rows, width), np.float32)
        self.versions = np.full((rows, width), -1, np.int32)
        self.lengths = np.zeros(rows, np.int32)
        self.finish = [""] * rows
        self.stops = np.asarray([] if forced else sampling.stop_tokens, np.int32)
        self.waiting = collections.deque(range(len(prompts)))
        self.ready: collections.deque = collections.deque()  # (prefix, version, prefix row, sample, row, token, lp)
        self.slot_row = np.full(self.engine.max_concurrent_decodes, -1, np.int64)
        self.stats = collections.Counter()
        self.prompt_ids = np.arange(len(prompts))
        # prompt p's samples are rows first_row[p] .. + samples[p] - 1; row r answers prompt row_prompt[r]
        self.row_prompt = np.arange(rows) // n
        self.first_row, self.samples = np.arange(len(prompts)) * n, np.full(len(prompts), n)
        e = self.engine
        self.pool = (PagePool(e.max_concurrent_decodes, e.page_size, e.kv_pages, e.decode_steps_per_call,
                              gen.admission) if e.paged else None)
        self.order = np.zeros(e.max_concurrent_decodes, np.int64)  # admission number of each slot's row
        self.admitted = 0
        self.parked: list[tuple[int, int, Any]] = []  # (admission number, row, host copy) oldest first
        cfg = self.engine.cfg
        self.routes = (np.full((rows, width, cfg.num_layers, cfg.num_experts_per_tok), -1, np.int16)
                       if self.engine.record_routes else None)
        self.prompt_routes: list[np.ndarray | None] = [None] * len(prompts)

    def loop(self, on_step) -> None:
        while True:
            self._swap_params()
            self._fill_slots()
            if not np.any(self.slot_row >= 0):
                assert not self.waiting and not self.ready and not self.parked
                return
            pages = self._make_room()
            if self.engine.decode_steps_per_call > 1:
                self._decode_chunk(pages)
            else:
                self.gen._state, result = self.engine.generate(self.gen._params, self.gen._state, **pages)
                self._record(*jax.device_get(_fields(result)))
                self.stats["decode_steps"] += 1
            if on_step is not None:
                on_step(self.gen, self.stats["decode_steps"])

    def _make_room(self) -> dict:
        """Paged: preempts the newest live sequences until the next call's pages are free; returns the
        engine call's ``pages`` bound."""
        if self.pool is None:
            return {}
        while self.pool.growth() > self.pool.free:
            assert self.pool.policy == "preempt", "admission under 'reserve' let the pool run short"
            assert np.sum(self.pool.live) > 1, "one sequence alone does not fit the pool"
            self._preempt(self.pool.victim(self.order))
        return {"pages": self.pool.bound()}

    def _preempt(self, slot: int) -> None:
        held = self.pool.stop(slot)
        self.gen._state, parked = self.engine.evict(self.gen._state, slot, pages=held)
        entry = (int(self.order[slot]), int(self.slot_row[slot]), jax.device_get(parked))  # host memory
        self.parked.append(entry)
        self.parked.sort(key=lambda e: e[0])
        self.slot_row[slot] = -1
        self.stats["preemptions"] += 1

    def _resume_parked(self, free: list) -> bool:
        """Resumes parked sequences, oldest first, while slots and pages allow; False if one must wait."""
        while self.parked and free:
            order, row, parked = self.parked[0]
            length, steps = int(parked.length), int(parked.steps)
            limit = int(self.limits[self.row_prompt[row]])
            if not self.pool.fits(length, steps, limit):
                return False
            self.parked.pop(0)
            slot = free.pop(0)
            self.gen._state = self.engine.resume(parked, self.gen._state, slot)
            self.pool.start(slot, length, steps, limit, held=int(parked.held))
            self.slot_row[slot], self.order[slot] = row, order
        return not self.parked

    def _decode_chunk(self, pages: dict) -> None:
        """One ``generate_steps`` call: its k steps recorded in order until no slot is live."""
        self.gen._state, result = self.engine.generate_steps(self.gen._params, self.gen._state, **pages)
        chunk = jax.device_get(_fields(result))
        for step in zip(*chunk, strict=True):
            if not np.any(self.slot_row >= 0):
                assert not np.any(step[2]), "the device ran a step after every slot had finished"
                break
            self._record(*step)
            self.stats["decode_steps"] += 1
        self.stats["decode_calls"] += 1

    def result(self, seconds: float) -> Rollouts:
        n = self.sampling.n
        rows = self.lengths.shape[0]
        steps = self.stats["decode_steps"]
        stats = {**self.stats, "tokens": int(self.lengths.sum()), "seconds": seconds,
                 "slot_occupancy": self.stats["slot_steps"] / max(1, steps * self.engine.max_concurrent_decodes),
                 "mean_live": self.stats["slot_steps"] / max(1, steps)}
        if self.pool is not None:
            stats.update(peak_pages=self.pool.peak_used, kv_pages=self.pool.total)
        routes = None if self.routes is None else (self.routes, self._padded_prompt_routes()[np.arange(rows) // n])
        return Rollouts(self.tokens, self.logprobs, self.lengths, tuple(self.finish), self.versions,
                        np.arange(rows) // n, np.arange(rows) % n, stats, *(routes or ()))

    def _swap_params(self) -> None:
        gen = self.gen
        with gen._lock:
            if gen._pending is not None:
                (gen._params, gen.version), gen._pending = gen._pending, None
                self.stats["param_swaps"] += 1

    def _fill_slots(self) -> None:
        if self.refill == "static" and np.any(self.slot_row >= 0):
            return
        free = self._free_slots()
        if self.pool is not None and not self._resume_parked(free):
            return  # the oldest preempted sequence goes first
        current, placed = None, []  # the samples of one prefix go in with one insert_many call
        while free and (self.ready or self.waiting):
            if not self.ready:
                self._prefill_next()
            prefix, version, prow, sample, row, token, logprob = self.ready[0]
            if not self._ends_at_once(row, token) and not self._admissible(row):
                break
            self.ready.popleft()
            if self._append(row, token, logprob, version):
                self._finished(row, None)
                continue  # finished with its first token
            if prefix is not current:
                self._insert(current, placed)
                current, placed = prefix, []
            slot = free.pop(0)
            placed.append((slot, prow, sample))
            self._admit(slot, row)
        self._insert(current, placed)
        self.stats["peak_live"] = max(self.stats["peak_live"], int(np.sum(self.slot_row >= 0)))

    def _free_slots(self) -> list:
        return list(np.flatnonzero(self.slot_row < 0))

    def _ends_at_once(self, row: int, token) -> bool:
        return token in self.stops or self.limits[self.row_prompt[row]] <= 1

    def _admissible(self, row: int) -> bool:
        if self.pool is None:
            return True
        prompt = self.row_prompt[row]
        return self.pool.fits(self.prompts[prompt].size, 1, int(self.limits[prompt]))

    def _admit(self, slot: int, row: int) -> None:
        self.slot_row[slot], self.order[slot] = row, self.admitted
        self.admitted += 1
        if self.pool is not None:
            prompt = self.row_prompt[row]
            self.pool.start(slot, self.prompts[prompt].size, 1, int(self.limits[prompt]))

    def _insert(self, prefix, placed: list[tuple[int, int, int]]) -> None:
        if placed:
            slots, rows, samples = zip(*placed, strict=True)
            self.gen._state = self.engine.insert_many(prefix, self.gen._state, slots, rows, samples)
            self.stats["insert_calls"] += 1

    def _prefill_next(self) -> None:
        batch, longest = self.engine.max_prefill_batch, self.engine.max_prefill_length
        if self.prompts[self.waiting[0]].size > longest:
            self._prefill_chunked(self.waiting.popleft())
            return
        take, n = [], self.samples[self.waiting[0]]  # one prefill shares its samples count
        while (self.waiting and len(take) < batch and self.prompts[self.waiting[0]].size <= longest
               and self.samples[self.waiting[0]] == n):
            take.append(self.waiting.popleft())
        padded = self._padded(take)
        prompts = [self.prompts[i] for i in padded]
        t = max(p.size for p in prompts)
        tokens = np.stack([np.pad(p, (0, t - p.size)) for p in prompts])
        prefix, first = self.engine.prefill(params=self.gen._params, padded_tokens=tokens,
                                            true_length=[p.size for p in prompts], requests=self._requests(padded),
                                            num_samples=int(n))
        self._ready(prefix, first, take)

    def _padded(self, take: list[int]) -> list[int]:
        """The prompts of one prefill, repeated up to full batches: one program per length bucket."""
        return take + take[-1:] * (self.engine.max_prefill_batch - len(take))

    def _prefill_chunked(self, prompt: int) -> None:
        """A prompt longer than max_prefill_length, alone, chunk after chunk onto the growing prefix."""
        tokens, prefix, start = self.prompts[prompt], None, 0
        requests = self._requests([prompt])
        for size in self.engine.prefill_chunks(tokens.size):
            prefix, first = self.engine.prefill(params=self.gen._params, existing_prefix=prefix,
                                                padded_tokens=tokens[start:start + size], true_length=size,
                                                requests=requests, num_samples=int(self.samples[prompt]))
            start += size
            self.stats["prefill_chunks"] += 1
            self._prompt_routes(first, [prompt], [size], append=True)
        self._ready(prefix, first, [prompt], routes=False)

    def _requests(self, prompts: list[int]):
        s = self.sampling
        return make_requests(len(prompts), self.engine.max_stop_tokens, seed=s.seed, prompt=self.prompt_ids[prompts],
                             temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, limit=self.limits[prompts],
                             stop_tokens=self.stops.tolist())

    def _ready(self, prefix, first, take: list[int], routes: bool = True) -> None:
        """The first tokens of a prefill's prompts ``take`` (its first rows) wait for slots (and their prompts'
        routes are kept, unless ``routes`` is False: a chunked prefill keeps them chunk by chunk)."""
        if routes:
            self._prompt_routes(first, take, [self.prompts[i].size for i in take])
        first_tokens, first_logprobs = jax.device_get((first.tokens, first.logprobs))
        self.stats["prefill_tokens"] += sum(self.prompts[p].size for p in take)
        for prow, prompt in enumerate(take):
            for j in range(self.samples[prompt]):
                self.ready.append((prefix, self.gen.version, prow, j, self.first_row[prompt] + j,
                                   first_tokens[prow, j], first_logprobs[prow, j]))
        self.stats["prefill_calls"] += 1
        self.stats["prefill_rows"] += len(take)

    def _prompt_routes(self, first, take: list[int], sizes: list[int], append: bool = False) -> None:
        """Keeps the routes of the prompt tokens a prefill ran (its rows ``take``, ``sizes`` tokens each)."""
        if self.routes is None:
            return
        routes = np.asarray(jax.device_get(first.routes), self.routes.dtype)
        for prow, (prompt, size) in enumerate(zip(take, sizes, strict=True)):
            mine = routes[prow, :size]
            before = self.prompt_routes[prompt]
            self.prompt_routes[prompt] = np.concatenate([before, mine]) if append and before is not None else mine

    def _padded_prompt_routes(self) -> np.ndarray:
        """[prompts, max_prompt_length, layers, k]: each prompt's routes right-aligned, -1 before them."""
        out = np.full((len(self.prompts), self.engine.max_prompt_length, *self.routes.shape[2:]), -1, np.int16)
        for i, r in enumerate(self.prompt_routes):
            if r is not None and len(r):
                out[i, -len(r):] = r
        return out

    def _append(self, row: int, token, logprob, version: int) -> bool:
        """Records one token of ``row``; True when the row is finished."""
        i = self.lengths[row]
        self.tokens[row, i], self.logprobs[row, i], self.versions[row, i] = token, logprob, version
        self.lengths[row] = i + 1
        stopped = token in self.stops
        if stopped or i + 1 >= self.limits[self.row_prompt[row]]:
            self.finish[row] = "stop" if stopped else "length"
            return True
        return False

    def _record(self, tokens, logprobs, valid, done, routes=None) -> None:
        live = np.flatnonzero(self.slot_row >= 0)
        assert np.all(valid[live]), "a slot the driver thinks live was inactive on the device"
        self.stats["slot_steps"] += live.size
        version = self.gen.version
        for slot in live:
            row = self.slot_row[slot]
            if routes is not None:  # the step ran the row's last token so far through the model
                self.routes[row, self.lengths[row] - 1] = routes[slot]
            finished = self._append(row, tokens[slot], logprobs[slot], version)
            assert finished == bool(done[slot]), f"slot {slot}: host and device disagree on the row's end"
            if finished:
                self.slot_row[slot] = -1
                self._finished(int(row), int(slot))
        if self.pool is not None:
            self.pool.step(live, done[live])

    def _finished(self, row: int, slot: int | None) -> None:
        """Row ``row`` ended, in ``slot`` (None: with its first token, before it had one); a hook."""


def prompt_id_array(given: Sequence[int] | None, count: int) -> np.ndarray:
    """The rollouts call's request ids (one per prompt; default 0, 1, ...) as an int64 array, checked."""
    ids = np.arange(count) if given is None else np.asarray(given, np.int64).reshape(-1)
    if ids.shape[0] != count or np.any(ids < 0) or np.any(ids >= 2**31):
        raise EngineError(f"prompt_ids needs one id in [0, 2**31) per prompt ({count} prompts)")
    return ids


def _fields(result) -> tuple:
    """What the driver reads of an engine call's results (the routes too when the engine records them)."""
    out = (result.tokens, result.logprobs, result.valid, result.done)
    return out if result.routes is None else (*out, result.routes)


def rollouts(engine: JaxEngine, params: Params, prompts: Sequence[Sequence[int]], sampling: SamplingParams,
             **kwargs) -> Rollouts:
    """One-shot :meth:`Generator.rollouts` with a fresh decode state (keyword arguments pass through)."""
    return Generator(engine, params).rollouts(prompts, sampling, **kwargs)
