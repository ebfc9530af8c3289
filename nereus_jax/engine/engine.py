"""The inference engine of one actor-gen replica, with JetStream's ``Engine`` contract.

JetStream's verbs and meaning, declared here (we do not depend on the archived package): ``prefill`` a
prompt into a :class:`Prefix` (its KV cache) and its first token, ``insert`` the prefix into a decode
slot, ``generate`` one token for every live slot per call. The decode state holds one KV cache per layer,
``[slots, kv_heads, max_target_length, head_dim]``, sharded over kv heads on the replica's ``tp`` axis
(kv heads stored repeated when tp exceeds them, as the layout stores the weights); each slot has its own
length, so slots finish and refill independently. Slots stop by themselves at their request's token
limit or a stop token (``ResultTokens.done``).

``decode_steps_per_call=k`` (default 1) adds :meth:`JaxEngine.generate_steps`: k decode steps in one jitted
call (a ``while_loop`` over the single step, stopping early once no slot is live), tokens ``[k, slots]``. The
host dispatches once per k tokens instead of once per token; a slot that finishes inside the call stays
empty until the call returns. Sampling keys depend on the request and the token's index only, so the tokens
are the same as k calls of ``generate``.

Extensions a JetStream engine lacks, all keyword arguments with defaults: ``prefill`` takes a batch of
prompts, per-row :class:`~nereus_jax.engine.sampling.Requests` and ``num_samples`` (n samples of a
prompt share one prefill and get n first tokens); ``insert`` takes which ``row`` and ``sample`` of the
prefix to place. Prompt lengths are bucketed (powers of two up to ``max_prefill_length``), so a steady
workload compiles a fixed set of programs; ``traces`` counts every trace (= compilation) by function.
Prompts up to ``max_prompt_length`` (default ``max_prefill_length``) are served: the driver prefills a longer
one in chunks of ``max_prefill_length`` (``prefill`` after ``existing_prefix``), so no prefill program spans
more than that many tokens (its attention scores are chunk x context, not prompt x prompt).
``record_routes=True`` (mixture-of-experts models) makes every result carry the router's top-k per layer of
the tokens the call ran through the model (``ResultTokens.routes``: a prefill's prompt tokens, a decode step's
fed tokens), for routing replay in training; a prefill then runs its last layer on every prompt token.
:meth:`JaxEngine.prefill_slots` (a conversation's next turn onto the cache it left in its slot; contiguous
engines) prefills in chunks of ``turn_chunk`` tokens (default ``min(128, max_prefill_length)``) over the whole
slot, so its programs are one per (rows, chunk) bucket, :meth:`JaxEngine.turn_shapes`, whatever the sequences'
lengths; :meth:`JaxEngine.warm_turns` compiles them all before the turns need them.

Paged KV memory (opt-in, ``page_size=16`` say; ``nereus_jax.engine.paged``): keys and values live in a pool
of ``kv_pages`` pages per layer (default: every slot's full ``max_target_length``; ``kv_bytes`` sizes it by a
budget) with a page table per slot. ``insert`` takes the pages a prompt fills, a step takes a page when a
slot's next position starts one, a finishing slot gives its pages back in the same step, and attention
reads only the pages each slot holds, so a step costs the tokens held, not ``slots x max_target_length``.
``generate(..., pages=n)`` bounds the pages a step reads (the driver knows it; otherwise the engine reads the
lengths back), bucketed in x1.5 / x4/3 steps from ``max_concurrent_decodes``: one program per bucket. A slot that
finds no free page waits (``valid=False``, its state untouched) while the others go on, and ``insert``
without room leaves the slot empty; the driver's admission control keeps both from happening.
:meth:`JaxEngine.evict` / :meth:`JaxEngine.resume` take a sequence's pages out and put them back, bit for
bit (preemption). A sequence's tokens and log-probabilities depend on neither the pool, the capacity, other
slots nor the schedule; they are the unpaged engine's tokens, with log-probabilities equal to float
rounding (that engine's attention sums over all max_target_length positions, and XLA:CPU's sums over a
different number of terms round differently).

    engine = JaxEngine(cfg, make_mesh(jax.devices()[:2], Layout(tp=2)), max_concurrent_decodes=8)
    params = engine.load_params(init_params(cfg))
    state = engine.init_decode_state()
    prefix, first = engine.prefill(params=params, padded_tokens=prompt, true_length=len(prompt))
    state = engine.insert(prefix, state, slot=0)
    state, result = engine.generate(params, state)      # result.tokens[0] is the second token
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from nereus_jax.config import ModelConfig
from nereus_jax.engine.contract import DecodeState, Engine, EngineError, Params, Parked, Prefix, ResultTokens
from nereus_jax.engine.programs import DecodePrograms
from nereus_jax.engine.sampling import Requests, make_requests
from nereus_jax.models.decoder import abstract_params
from nereus_jax.models.lora import base_config, has_adapters
from nereus_jax.sharding import (
    Layout,
    kv_repeat,
    make_mesh,
    shard_params,
    stored_shapes,
)

__all__ = ["DecodeState", "Engine", "EngineError", "JaxEngine", "Params", "Parked", "Prefix", "ResultTokens"]
_MIN_BUCKET = 16


class JaxEngine:
    """Our engine: the decoder of ``nereus_jax.models`` on one replica's ("pp", "tp") mesh (pp = 1)."""

    def __init__(self, cfg: ModelConfig, mesh: Mesh | None = None, *, max_concurrent_decodes: int = 32,
                 max_prefill_length: int = 128, max_target_length: int | None = None,
                 max_prefill_batch: int = 8, max_stop_tokens: int = 4, tokenizer: Any = None,
                 decode_steps_per_call: int = 1, page_size: int | None = None, kv_pages: int | None = None,
                 kv_bytes: int | None = None, max_prompt_length: int | None = None, record_routes: bool = False,
                 turn_chunk: int | None = None):
        # A model with LoRA adapters generates with them merged into its weights (once per load/adopt); the
        # engine itself runs the base architecture.
        self.adapters_cfg = cfg if cfg.lora_rank else None
        self.cfg = cfg = base_config(cfg)
        self._mesh = mesh if mesh is not None else make_mesh(jax.devices()[:1], Layout())
        self.layout = _layout_of(self._mesh)
        self._slots = _positive("max_concurrent_decodes", max_concurrent_decodes)
        self._max_prefill = _positive("max_prefill_length", max_prefill_length)
        self.max_target_length = max_target_length or max_prefill_length + 128
        if self.max_target_length < self._max_prefill:
            raise EngineError(f"max_target_length ({self.max_target_length}) must be >= max_prefill_length "
                              f"({self._max_prefill})")
        self.max_prompt_length = self._max_prefill if max_prompt_length is None else int(max_prompt_length)
        if not self._max_prefill <= self.max_prompt_length < self.max_target_length:
            raise EngineError(f"max_prompt_length ({self.max_prompt_length}) must be in [max_prefill_length, "
                              f"max_target_length) = [{self._max_prefill}, {self.max_target_length})")
        self.max_prefill_batch = _positive("max_prefill_batch", max_prefill_batch)
        self.max_stop_tokens = _positive("max_stop_tokens", max_stop_tokens)
        self.decode_steps_per_call = _positive("decode_steps_per_call", decode_steps_per_call)
        self.kv_heads = cfg.num_kv_heads * kv_repeat(cfg, self.layout)
        self.dtype = jnp.dtype(cfg.compute_dtype)
        self.prefill_lengths = _buckets(self._max_prefill)
        self.prefill_batches = _buckets(self.max_prefill_batch, smallest=1)
        self.slot_widths = _buckets(self.max_target_length)  # take_cache copies
        self.turn_chunk = min(128, self._max_prefill) if turn_chunk is None else _positive("turn_chunk", turn_chunk)
        if self.turn_chunk > self._max_prefill:
            raise EngineError(f"turn_chunk ({self.turn_chunk}) must be <= max_prefill_length ({self._max_prefill})")
        self.turn_lengths = _buckets(self.turn_chunk)  # prefill_slots' chunk buckets
        self._turns_seen: set[tuple[int, int]] = set()  # prefill_slots shapes run (compiled) so far
        self.traces: collections.Counter[str] = collections.Counter()
        self._tokenizer = tokenizer
        self._stored_shapes: tuple[ModelConfig, dict] | None = None
        self._init_paging(page_size, kv_pages, kv_bytes)
        if record_routes and not cfg.num_experts:
            raise EngineError("record_routes needs a mixture-of-experts model (model.num_experts > 0)")
        self.record_routes = bool(record_routes)
        self._programs = DecodePrograms(
            cfg, self._mesh, self.layout, slots=self._slots, max_target_length=self.max_target_length,
            kv_heads=self.kv_heads, max_stop_tokens=self.max_stop_tokens,
            decode_steps_per_call=self.decode_steps_per_call, page_size=self.page_size, kv_pages=self.kv_pages,
            pages_per_slot=self.pages_per_slot, traces=self.traces, adapters=self.adapters_cfg,
            record_routes=self.record_routes)

    def _init_paging(self, page_size: int | None, kv_pages: int | None, kv_bytes: int | None) -> None:
        self.page_size = None if page_size is None else _positive("page_size", page_size)
        if page_size is None:
            if kv_pages is not None or kv_bytes is not None:
                raise EngineError("kv_pages / kv_bytes size a paged KV pool: give page_size too")
            self.pages_per_slot = self.kv_pages = 0
            return
        self.pages_per_slot = -(-self.max_target_length // self.page_size)
        if kv_pages is not None and kv_bytes is not None:
            raise EngineError("give kv_pages or kv_bytes, not both")
        if kv_bytes is not None:
            kv_pages = int(kv_bytes) // self.kv_page_bytes
        self.kv_pages = _positive("kv_pages", self._slots * self.pages_per_slot if kv_pages is None else kv_pages)
        self.item_buckets = _item_buckets(min(self._slots, self.kv_pages),
                                          min(self.kv_pages, self._slots * self.pages_per_slot))

    @property
    def paged(self) -> bool:
        return self.page_size is not None

    @property
    def kv_page_bytes(self) -> int:
        """Bytes of one page over all layers, keys and values (kv heads as stored, all devices together)."""
        return 2 * self.cfg.num_layers * self.kv_heads * (self.page_size or 1) * self.cfg.head_dim * self.dtype.itemsize

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes of a decode state's KV memory: the pool when paged, slots x max_target_length otherwise."""
        if self.paged:
            return self.kv_pages * self.kv_page_bytes
        return self._slots * self.max_target_length * self.kv_page_bytes

    def prefill_chunks(self, tokens: int) -> list[int]:
        """The chunk lengths a prompt of ``tokens`` is prefilled in (the driver's chunked prefill): whole
        ``max_prefill_length`` chunks, then the rest."""
        whole, rest = divmod(int(tokens), self._max_prefill)
        return [self._max_prefill] * whole + ([rest] if rest else [])

    def prefill_width(self, tokens: int) -> int:
        """The cache length of a prefix prefilled in :meth:`prefill_chunks` (each chunk padded to its
        bucket); it must fit ``max_target_length``."""
        return sum(_bucket(n, self.prefill_lengths) for n in self.prefill_chunks(tokens))

    def pages_for(self, tokens: int) -> int:
        """Pages that hold ``tokens`` positions."""
        return -(-int(tokens) // self.page_size)

    # ----------------------------------------------------------------------------------- the contract
    @property
    def max_concurrent_decodes(self) -> int:
        return self._slots

    @property
    def max_prefill_length(self) -> int:
        return self._max_prefill

    @property
    def samples_per_slot(self) -> int:
        return 1  # a slot decodes one sequence; n samples of a prompt take n slots and share one prefill

    @property
    def mesh(self) -> Mesh:
        return self._mesh

    def get_tokenizer(self) -> Any:
        return self._tokenizer

    def get_prefix_destination_sharding(self) -> Prefix:
        return self._programs.prefix_sharding()

    def load_params(self, params: dict) -> Params:
        """Lays a canonical parameter tree (``init_params``, a checkpoint, a trainer's) out for generation:
        sharded with the "gen" rules, kv heads repeated where tp exceeds them, cast to compute dtype,
        layers unstacked. Any layout of the input works; inputs are untouched."""
        cfg = self._tree_cfg(params)
        _check_tree(params, cfg)
        return self._programs.unstack(shard_params(params, cfg, self.layout, self._mesh, kind="gen"))

    def _tree_cfg(self, params: dict) -> ModelConfig:
        """The config ``params`` is a tree of: the base's, or with adapters (LoRA) the adapted model's."""
        return self.adapters_cfg if self.adapters_cfg is not None and has_adapters(params["layers"]) else self.cfg

    def adopt_params(self, params: dict) -> Params:
        """Parameters already laid out for this engine (its layout, on its mesh, kv heads stored as the
        layout stores them), e.g. a generation unit's after the weight sync: only cast to the compute
        dtype and unstacked, on device, with no host round trip."""
        cfg = self._tree_cfg(params)
        if self._stored_shapes is None or self._stored_shapes[0] is not cfg:  # abstract_params traces the model
            self._stored_shapes = (cfg, stored_shapes(cfg, self.layout))
        want = self._stored_shapes[1]
        got = jax.tree.map(lambda x: tuple(np.shape(x)), dict(params))
        if want != got:
            raise EngineError(f"parameters are not laid out for this engine's {self.layout}: use load_params "
                              "for a canonical tree")
        return self._programs.unstack(params)

    def init_decode_state(self) -> DecodeState:
        return self._programs.init_state()

    def prefill(self, *, params: Params, existing_prefix: Prefix | None = None, padded_tokens,
                true_length, requests: Requests | None = None, num_samples: int = 1
                ) -> tuple[Prefix, ResultTokens]:
        """Prefills ``padded_tokens`` ([t] or [rows, t], right-padded; ``true_length`` int or [rows]) after
        ``existing_prefix``'s tokens if given. Rows and length are padded up to their buckets. Returns the
        prefix and first tokens ``[rows, num_samples]``, drawn with ``requests`` (default: greedy)."""
        tokens_bt, true_b = self._check_prompts(padded_tokens, true_length)
        rows = tokens_bt.shape[0]
        base_len = 0 if existing_prefix is None else int(existing_prefix.caches[0][0].shape[2])
        requests = self._check_requests(requests, rows, true_b, existing_prefix)
        if num_samples < 1:
            raise EngineError(f"num_samples must be >= 1, got {num_samples}")
        tokens_bt, true_b, requests = self._pad_rows(tokens_bt, true_b, requests, existing_prefix)
        length = _bucket(tokens_bt.shape[1], self.prefill_lengths)
        if base_len + length > self.max_target_length:
            raise EngineError(f"existing prefix ({base_len}) + prompt bucket ({length}) exceeds max_target_length "
                              f"({self.max_target_length})")
        tokens_bt = np.pad(tokens_bt, ((0, 0), (0, length - tokens_bt.shape[1])))
        if existing_prefix is None:
            base, start = self._programs.empty_prefix(tokens_bt.shape[0]), np.zeros(tokens_bt.shape[0], np.int32)
        else:
            base, start = existing_prefix.caches, existing_prefix.lengths
        prefix, result = self._programs.prefill(params, tokens_bt, true_b, start, base, requests, num_samples)
        return prefix, jax.tree.map(lambda x: x[:rows], result)

    def insert(self, prefix: Prefix, decode_state: DecodeState, slot: int, *, row: int = 0,
               sample: int = 0) -> DecodeState:
        """Places sample ``sample`` of prefix row ``row`` in ``slot`` (whatever the slot held is dropped).
        ``decode_state`` is donated: use only the returned state."""
        self._check_slot(slot)
        rows, n = prefix.first_tokens.shape
        if not (0 <= row < rows and 0 <= sample < n):
            raise EngineError(f"prefix has {rows} rows x {n} samples; row {row}, sample {sample} is out of range")
        if prefix.caches[0][0].shape[2] > self.max_target_length:
            raise EngineError(f"prefix of {prefix.caches[0][0].shape[2]} tokens does not fit the cache "
                              f"({self.max_target_length})")
        index = (lambda i: np.full((1,), i, np.int32)) if self.paged else np.int32
        return self._programs.insert(prefix, decode_state, index(slot), index(row), index(sample))

    def insert_many(self, prefix: Prefix, decode_state: DecodeState, slots: Sequence[int], rows: Sequence[int],
                    samples: Sequence[int]) -> DecodeState:
        """``insert(prefix, state, slots[i], row=rows[i], sample=samples[i])`` for every i in one call (one
        dispatch instead of one per sample; the same state, bit for bit). Slots must be distinct.
        ``decode_state`` is donated: use only the returned state."""
        slots, rows, samples = (np.asarray(a, np.int32).reshape(-1) for a in (slots, rows, samples))
        k = slots.shape[0]
        if not (0 < k <= self._slots and rows.shape[0] == k and samples.shape[0] == k):
            raise EngineError(f"insert_many needs 1 to {self._slots} (slot, row, sample) triples of equal length, "
                              f"got {k}, {rows.shape[0]}, {samples.shape[0]}")
        if np.unique(slots).size != k or slots.min() < 0 or slots.max() >= self._slots:
            raise EngineError(f"slots {slots.tolist()} must be distinct and in [0, {self._slots})")
        n_rows, n = prefix.first_tokens.shape
        if rows.min() < 0 or rows.max() >= n_rows or samples.min() < 0 or samples.max() >= n:
            raise EngineError(f"prefix has {n_rows} rows x {n} samples; rows {rows.tolist()} / samples "
                              f"{samples.tolist()} are out of range")
        if prefix.caches[0][0].shape[2] > self.max_target_length:
            raise EngineError(f"prefix of {prefix.caches[0][0].shape[2]} tokens does not fit the cache "
                              f"({self.max_target_length})")
        pad = self._slots - k  # always max_concurrent_decodes entries: one program per prefix shape
        slots = np.concatenate([slots, np.full(pad, self._slots, np.int32)])  # out of range: dropped
        rows, samples = (np.concatenate([a, np.zeros(pad, np.int32)]) for a in (rows, samples))
        return self._programs.insert_many(prefix, decode_state, slots, rows, samples)

    def generate(self, params: Params, decode_state: DecodeState, *, pages: int | None = None
                 ) -> tuple[DecodeState, ResultTokens]:
        """One decode step for every slot (inactive slots yield ``valid=False``). ``decode_state`` is
        donated: use only the returned state. Parameters may change between calls (a swap keeps slots).
        Paged: ``pages`` bounds the pages the step reads (see the module docstring)."""
        if not self.paged:
            return self._programs.generate(params, decode_state)
        return self._programs.generate(params, decode_state, self._items(decode_state, pages, 1))

    def generate_steps(self, params: Params, decode_state: DecodeState, *, pages: int | None = None
                       ) -> tuple[DecodeState, ResultTokens]:
        """``decode_steps_per_call`` decode steps in one call: results ``[k, slots]``, step j of slot s at
        ``[j, s]``. A slot that finishes stays inactive (``valid=False``) for the rest of the call; the call
        stops early once no slot is live (the steps not run are all ``valid=False``). ``decode_state`` is
        donated; the parameters are the same for all k steps. Paged: ``pages`` bounds the pages read at
        any of the k steps."""
        if not self.paged:
            return self._programs.generate_steps(params, decode_state)
        return self._programs.generate_steps(params, decode_state, self._items(decode_state, pages,
                                                                      self.decode_steps_per_call))

    def prefill_slots(self, params: Params, decode_state: DecodeState, slots: Sequence[int], padded_tokens,
                      true_length, requests: Requests) -> tuple[DecodeState, ResultTokens]:
        """Continues sequences whose KV caches are still in their slots (a finished turn's, the slot not
        reused since; contiguous engines): row i's tokens (``padded_tokens`` [rows, t], right-padded,
        ``true_length`` [rows]) are prefilled onto slot ``slots[i]``'s cache from its length on, row i's first
        token is drawn under ``requests`` row i (as token 0 of a response), and the slot decodes on from it
        with that request; a first token that ends the request leaves the slot inactive. Many sequences in
        one call, so a conversation's next turn is neither a prefill of the whole conversation nor a copy of
        its cache. The tokens go in chunks of at most ``turn_chunk`` (one program call per chunk, the rows
        still holding tokens; a chunk's draw is kept only for the rows it ends), each padded to one of the
        :meth:`turn_shapes`: a bounded set of programs, all compiled up front by :meth:`warm_turns`. Results
        ``[rows, 1]``. ``decode_state`` is donated."""
        self._need_contiguous("prefill_slots")
        tokens_bt, true_b = self._check_prompts(padded_tokens, true_length)
        slots = np.asarray(slots, np.int32).reshape(-1)
        rows = tokens_bt.shape[0]
        if slots.shape[0] != rows or np.unique(slots).size != rows or slots.min() < 0 or slots.max() >= self._slots:
            raise EngineError(f"prefill_slots needs {rows} distinct slots in [0, {self._slots}), got {slots.tolist()}")
        start = np.asarray(jax.device_get(decode_state.lengths))[slots]
        requests = Requests(*[np.asarray(x) for x in requests])
        if requests.seed.shape != (rows,) or np.any(start + true_b + requests.limit > self.max_target_length):
            raise EngineError(f"{rows} requests needed, and each slot's length + tokens + limit <= "
                              f"max_target_length={self.max_target_length}; got lengths {start.tolist()}, tokens "
                              f"{true_b.tolist()}, limits {requests.limit.tolist()}")
        if self.record_routes and true_b.max() > self.turn_chunk:
            raise EngineError(f"recording routes, prefill_slots takes at most turn_chunk={self.turn_chunk} tokens a "
                              f"row (got {int(true_b.max())}): build the engine with a larger turn_chunk")
        parts = []  # (rows the chunk ended, their results)
        for at in range(0, int(true_b.max()), self.turn_chunk):
            take = np.flatnonzero(true_b > at)
            n = np.minimum(true_b[take] - at, self.turn_chunk)
            decode_state, result = self._prefill_chunk(params, decode_state, slots[take],
                                                       tokens_bt[take, at:at + int(n.max())], n,
                                                       Requests(*[x[take] for x in requests]))
            ends = np.flatnonzero(true_b[take] - at <= self.turn_chunk)
            parts.append((take[ends], result if ends.size == take.size else _rows(result, ends)))
        if len(parts) == 1:
            return decode_state, parts[0][1]
        order = np.argsort(np.concatenate([ended for ended, _ in parts]))
        return decode_state, jax.tree.map(lambda *x: jnp.concatenate(x)[order], *[r for _, r in parts])

    def _prefill_chunk(self, params: Params, decode_state: DecodeState, slots: np.ndarray, tokens_bt: np.ndarray,
                       true_b: np.ndarray, requests: Requests) -> tuple[DecodeState, ResultTokens]:
        """One :meth:`prefill_slots` program call: rows and tokens padded to their buckets."""
        rows = tokens_bt.shape[0]
        padded = _bucket(rows, self.prefill_batches)
        length = _bucket(tokens_bt.shape[1], self.turn_lengths)
        self._turns_seen.add((padded, length))
        tokens_bt = np.pad(tokens_bt, ((0, padded - rows), (0, length - tokens_bt.shape[1])))
        true_b = np.pad(true_b, (0, padded - rows), constant_values=1)
        slots = np.pad(slots, (0, padded - rows), constant_values=self._slots)  # out of range: dropped
        requests = Requests(*[np.concatenate([x, np.repeat(x[-1:], padded - rows, axis=0)]) for x in requests])
        state, result = self._programs.prefill_slots(params, decode_state, slots, tokens_bt, true_b, requests)
        return state, jax.tree.map(lambda x: x[:rows], result)

    def turn_shapes(self, max_rows: int | None = None, max_tokens: int | None = None) -> list[tuple[int, int]]:
        """The (rows, tokens) shapes of :meth:`prefill_slots`' programs: a row bucket of ``prefill_batches`` (up
        to the one holding ``max_rows``, default all) x a chunk bucket of ``turn_lengths`` (up to the one
        holding ``max_tokens``, default all). Each is one program; every call runs one of them, whatever its
        rows' lengths (attention reads the whole slot, as a contiguous engine's decode step does)."""
        rows = _bucket(_at_most(max_rows, self.max_prefill_batch), self.prefill_batches)
        tokens = _bucket(_at_most(max_tokens, self.turn_chunk), self.turn_lengths)
        return [(r, t) for r in self.prefill_batches if r <= rows for t in self.turn_lengths if t <= tokens]

    def warm_turns(self, params: Params, decode_state: DecodeState, max_rows: int | None = None,
                   max_tokens: int | None = None) -> DecodeState:
        """Compiles (by running, every row padding: nothing changes) each of :meth:`turn_shapes` not run yet,
        so that no conversation's turn waits for a compile; ``max_rows``: the most sequences one call will
        continue (e.g. the conversations on this engine), ``max_tokens``: the most tokens a row will append.
        ``decode_state`` is donated."""
        self._need_contiguous("warm_turns")
        for rows, length in self.turn_shapes(max_rows, max_tokens):
            if (rows, length) in self._turns_seen:
                continue
            slots = np.full(rows, self._slots, np.int32)  # out of range: every row is padding
            decode_state, _ = self._programs.prefill_slots(params, decode_state, slots,
                                                           np.zeros((rows, length), np.int32), np.ones(rows, np.int32),
                                                           make_requests(rows, self.max_stop_tokens))
            self._turns_seen.add((rows, length))
        return decode_state

    def take_cache(self, decode_state: DecodeState, slot: int, length: int) -> tuple:
        """A copy of slot ``slot``'s first ``length`` cache positions (padded to a width in
        :attr:`slot_widths`), per layer (k, v) ``[1, kv_heads, width, head_dim]``, e.g. to hand its slot to
        another sequence; :meth:`put_cache` puts it back (contiguous engines). The state is not changed."""
        self._need_contiguous("take_cache")
        self._check_slot(slot)
        if not 0 < length <= self.max_target_length:
            raise EngineError(f"length {length} is out of range (1 to max_target_length={self.max_target_length})")
        return self._programs.take_cache(decode_state, np.int32(slot), self.cache_width(length))

    def cache_width(self, length: int) -> int:
        """Positions a :meth:`take_cache` copy of ``length`` tokens holds."""
        return min(_bucket(length, self.slot_widths), self.max_target_length)

    def put_cache(self, decode_state: DecodeState, slot: int, caches: tuple, length: int) -> DecodeState:
        """Puts a :meth:`take_cache` copy (device or host arrays) into slot ``slot`` (whatever it held is
        dropped), holding ``length`` tokens and not decoding: :meth:`prefill_slots` continues it, bit for bit
        as if it had stayed. ``decode_state`` is donated."""
        self._need_contiguous("put_cache")
        self._check_slot(slot)
        if not 0 < length <= caches[0][0].shape[2] <= self.max_target_length:
            raise EngineError(f"length {length} does not fit the copy's {caches[0][0].shape[2]} positions")
        caches = jax.device_put(caches, self._programs.prefix_sharding().caches)
        return self._programs.put_cache(decode_state, np.int32(slot), caches, np.int32(length))

    def evict(self, decode_state: DecodeState, slot: int, *, pages: int | None = None
              ) -> tuple[DecodeState, Parked]:
        """Takes slot ``slot``'s sequence out (paged engines): its pages go back to the pool and come back
        as a :class:`Parked` copy (``pages`` bounds the pages it holds; default: a slot's most), and the slot
        is empty. ``decode_state`` is donated."""
        self._need_paged("evict")
        self._check_slot(slot)
        count = self.pages_per_slot if pages is None else _bucket(max(1, pages), _buckets(self.pages_per_slot, 1))
        return self._programs.evict(decode_state, np.int32(slot), count)

    def resume(self, parked: Parked, decode_state: DecodeState, slot: int) -> DecodeState:
        """Puts an evicted sequence into slot ``slot`` (fresh pages, the same contents; whatever the slot
        held is dropped) to go on where it stopped. Without room in the pool the slot stays empty.
        ``decode_state`` is donated."""
        self._need_paged("resume")
        self._check_slot(slot)
        parked = jax.device_put(parked, self._programs.parked_sharding())
        return self._programs.resume(parked, decode_state, np.int32(slot))

    def free_pages(self, decode_state: DecodeState) -> int:
        """Free pages of a paged decode state (reads the device)."""
        self._need_paged("free_pages")
        return int(decode_state.pages.free_count)

    # ------------------------------------------------------------------------------------ programs
    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self._slots:
            raise EngineError(f"slot {slot} is out of range: this engine has {self._slots} slots")

    def _need_contiguous(self, what: str) -> None:
        if self.paged:
            raise EngineError(f"{what} needs a contiguous KV cache (an engine built without page_size)")

    def _need_paged(self, what: str) -> None:
        if not self.paged:
            raise EngineError(f"{what} needs a paged engine (build it with page_size=...)")

    def _items(self, state: DecodeState, pages: int | None, steps: int) -> int:
        """The static work-item count for a step reading at most ``pages`` pages (read from the device
        when not given)."""
        if pages is None:
            lengths, active = jax.device_get((state.lengths, state.active))
            last = np.minimum(lengths + steps - 1, self.max_target_length - 1)
            pages = int(np.sum(np.where(active, last // self.page_size + 1, 0)))
        return _bucket(min(max(1, pages), self.item_buckets[-1]), self.item_buckets)

    # ------------------------------------------------------------------------------------ checking
    def _check_prompts(self, padded_tokens, true_length) -> tuple[np.ndarray, np.ndarray]:
        tokens_bt = np.asarray(padded_tokens)
        tokens_bt = tokens_bt[None] if tokens_bt.ndim == 1 else tokens_bt
        if tokens_bt.ndim != 2 or tokens_bt.shape[1] == 0 or not np.issubdtype(tokens_bt.dtype, np.integer):
            raise EngineError(f"padded_tokens must be integer token ids shaped [t] or [rows, t], got "
                              f"{tokens_bt.dtype}{list(tokens_bt.shape)}")
        rows, t = tokens_bt.shape
        true_b = np.broadcast_to(np.asarray(true_length, np.int32), (rows,)).copy()
        if t > self._max_prefill:
            raise EngineError(f"prompt of {t} tokens exceeds max_prefill_length={self._max_prefill}; "
                              "truncate it or build the engine with a larger max_prefill_length")
        if np.any(true_b < 1) or np.any(true_b > t):
            raise EngineError(f"true_length must be in [1, {t}] (the padded length), got {true_b.tolist()}")
        if rows > self.max_prefill_batch:
            raise EngineError(f"{rows} prompts in one prefill; this engine prefills at most "
                              f"max_prefill_batch={self.max_prefill_batch}")
        if np.any(tokens_bt < 0) or np.any(tokens_bt >= self.cfg.vocab_size):
            raise EngineError(f"token ids must be in [0, {self.cfg.vocab_size}) (the vocabulary)")
        return tokens_bt.astype(np.int32), true_b

    def _check_requests(self, requests, rows, true_b, existing_prefix) -> Requests:
        start = 0 if existing_prefix is None else np.asarray(existing_prefix.lengths)[:rows]
        if requests is None:
            return make_requests(rows, self.max_stop_tokens, limit=self.max_target_length - (start + true_b))
        requests = Requests(*[np.asarray(x) for x in requests])
        if requests.seed.shape != (rows,) or requests.stop.shape != (rows, self.max_stop_tokens):
            raise EngineError(f"requests must have {rows} rows and {self.max_stop_tokens} stop-token columns, got "
                              f"{requests.seed.shape[0]} and {requests.stop.shape[-1]}")
        over = start + true_b + requests.limit > self.max_target_length
        if np.any(requests.limit < 1) or np.any(over):
            raise EngineError(f"prompt length + token limit must be <= max_target_length={self.max_target_length} "
                              f"and limits >= 1; got lengths {(start + true_b).tolist()}, limits "
                              f"{requests.limit.tolist()}")
        return requests

    def _pad_rows(self, tokens_bt, true_b, requests, existing_prefix):
        rows = tokens_bt.shape[0]
        if existing_prefix is None:
            padded = _bucket(rows, self.prefill_batches)
        else:
            padded = existing_prefix.first_tokens.shape[0]
            if rows > padded:
                raise EngineError(f"{rows} prompts but the existing prefix has {padded} rows")
        extra = padded - rows
        tokens_bt = np.pad(tokens_bt, ((0, extra), (0, 0)))
        true_b = np.pad(true_b, (0, extra), constant_values=1)
        requests = Requests(*[np.concatenate([x, np.repeat(x[-1:], extra, axis=0)]) for x in requests])
        return tokens_bt, true_b, requests


def _layout_of(mesh: Mesh) -> Layout:
    if tuple(mesh.axis_names) not in (("pp", "tp"), ("pp", "expert", "tp")):
        raise EngineError(f"the engine serves one replica: a ('pp', 'tp') mesh, or ('pp', 'expert', 'tp') with "
                          f"expert parallelism (make_mesh without dp), got axes {mesh.axis_names}")
    if mesh.shape["pp"] != 1:
        raise EngineError(f"generation runs with pp=1 (got pp={mesh.shape['pp']}); use tp for a larger replica")
    return Layout(tp=mesh.shape["tp"], ep=dict(mesh.shape).get("expert", 1))


def _positive(name: str, value: int) -> int:
    if value < 1:
        raise EngineError(f"{name} must be >= 1, got {value}")
    return int(value)


def _at_most(n: int | None, top: int) -> int:
    """``n`` (at least 1) capped at ``top``; None: ``top``."""
    return top if n is None else min(max(1, int(n)), top)


def _buckets(top: int, smallest: int = _MIN_BUCKET) -> tuple[int, ...]:
    """``smallest`` times powers of two below ``top``, then ``top``."""
    out, b = [], smallest
    while b < top:
        out.append(b)
        b *= 2
    return (*out, top)


def _bucket(n: int, buckets: Sequence[int]) -> int:
    return next(b for b in buckets if b >= n)


def _rows(result: ResultTokens, rows: np.ndarray) -> ResultTokens:
    return jax.tree.map(lambda x: x[rows], result)


def _item_buckets(smallest: int, top: int) -> tuple[int, ...]:
    """``smallest`` x 1, 1.5, 2, 3, 4, 6, ... below ``top``, then ``top`` (padding wastes at most a third)."""
    out, b = [], smallest
    while b < top:
        out.append(b)
        b = max(b + 1, b * 3 // 2 if len(out) % 2 else b * 4 // 3)
    return (*out, top)


def _check_tree(params: dict, cfg: ModelConfig) -> None:
    want = jax.tree.map(lambda s: tuple(s.shape), abstract_params(cfg))
    got = jax.tree.map(lambda x: tuple(np.shape(x)), dict(params))
    if want != got:
        raise EngineError("parameters do not match the engine's model config (an lm-head decoder of "
                          f"{cfg.name!r}): pass the canonical tree of init_params(cfg) / a checkpoint")
