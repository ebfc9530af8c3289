"""The engine's device programs: the prefill, insert, decode-step, evict and resume functions over a
:class:`~nereus_jax.engine.contract.DecodeState`, jitted once per shape bucket with the shardings they
produce. :class:`~nereus_jax.engine.engine.JaxEngine` checks and buckets its callers' inputs and calls these;
everything here is traced (no host reads), dense or paged as the engine was built."""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from nereus_jax.config import ModelConfig
from nereus_jax.engine import decode, paged
from nereus_jax.engine.contract import DecodeState, Parked, Prefix, ResultTokens
from nereus_jax.engine.sampling import Requests, make_requests, sample_blocks
from nereus_jax.models.lora import merge_lora
from nereus_jax.sharding import Layout, activation_sharding, logical_to_spec, param_shardings


class DecodePrograms:
    """The jitted programs of one engine (``unstack``, ``init_state``, ``empty_prefix``, ``prefill``,
    ``insert``, ``insert_many``, ``generate``, ``generate_steps``; contiguous: ``prefill_slots``, ``take_cache``,
    ``put_cache``; paged: ``evict``, ``resume``), counting their traces in ``traces``."""

    def __init__(self, cfg: ModelConfig, mesh: Mesh, layout: Layout, *, slots: int, max_target_length: int,
                 kv_heads: int, max_stop_tokens: int, decode_steps_per_call: int, page_size: int | None,
                 kv_pages: int, pages_per_slot: int, traces: collections.Counter,
                 adapters: ModelConfig | None = None, record_routes: bool = False):
        self.cfg, self._mesh, self.layout = cfg, mesh, layout
        self.record_routes = record_routes  # results carry routes (ResultTokens.routes)
        self.adapters = adapters  # the LoRA model's config: unstack merges adapters found in its input
        self._slots, self.max_target_length, self.kv_heads = slots, max_target_length, kv_heads
        self.max_stop_tokens, self.decode_steps_per_call = max_stop_tokens, decode_steps_per_call
        self.page_size, self.kv_pages, self.pages_per_slot = page_size, kv_pages, pages_per_slot
        self.paged = page_size is not None
        self.dtype = jnp.dtype(cfg.compute_dtype)
        self.traces = traces
        self._build()

    def prefix_sharding(self) -> Prefix:
        rep = self.replicated
        caches = tuple((self.cache_sharding, self.cache_sharding) for _ in range(self.cfg.num_layers))
        return Prefix(caches, rep, rep, rep, Requests(*[rep] * len(Requests._fields)))

    def _build(self) -> None:
        mesh, cfg = self._mesh, self.cfg
        self.replicated = NamedSharding(mesh, PartitionSpec())
        spec = logical_to_spec(("batch", "kv_heads", "length", "head_dim"), "gen", mesh.axis_names)
        self.cache_sharding = NamedSharding(mesh, spec)
        self.pool_sharding = NamedSharding(mesh, logical_to_spec((None, "kv_heads", None, "head_dim"), "gen",
                                                                  mesh.axis_names))
        state_sh = self.state_shardings()
        prefix_sh = self.prefix_sharding()
        result_sh = ResultTokens(*[self.replicated] * 5, self.replicated if self.record_routes else None)
        stacked = param_shardings(cfg, self.layout, mesh, kind="gen", head="lm")
        unstacked = {**stacked, "layers": tuple(jax.tree.map(_drop_layer_axis, stacked["layers"])
                                                for _ in range(cfg.num_layers))}
        self.unstack = jax.jit(self._traced("unstack", self._unstack_impl), out_shardings=unstacked)
        self.init_state = jax.jit(self._traced("init_decode_state", self._init_state_impl), out_shardings=state_sh)
        self.empty_prefix = jax.jit(self._traced("empty_prefix", self._empty_prefix_impl), static_argnums=0,
                                     out_shardings=prefix_sh.caches)
        self.prefill = jax.jit(self._traced("prefill", self._prefill_impl), static_argnums=6,
                                out_shardings=(prefix_sh, result_sh))
        insert, insert_many = ((self._paged_insert_impl,) * 2 if self.paged else
                               (self._insert_impl, self._insert_many_impl))
        self.insert = jax.jit(self._traced("insert", insert), donate_argnums=1, out_shardings=state_sh)
        self.insert_many = jax.jit(self._traced("insert_many", insert_many), donate_argnums=1,
                                    out_shardings=state_sh)
        step = (2,) if self.paged else ()  # paged: the static count of attention work items
        self.generate = jax.jit(self._traced("generate", self._generate_impl), donate_argnums=1,
                                 static_argnums=step, out_shardings=(state_sh, result_sh))
        self.generate_steps = jax.jit(self._traced("generate_steps", self._generate_steps_impl), donate_argnums=1,
                                       static_argnums=step, out_shardings=(state_sh, result_sh))
        if not self.paged:
            self.prefill_slots = jax.jit(self._traced("prefill_slots", self._prefill_slots_impl), donate_argnums=1,
                                         out_shardings=(state_sh, result_sh))
            self.take_cache = jax.jit(self._traced("take_cache", self._take_cache_impl), static_argnums=2,
                                      out_shardings=prefix_sh.caches)
            self.put_cache = jax.jit(self._traced("put_cache", self._put_cache_impl), donate_argnums=0,
                                     out_shardings=state_sh)
        if self.paged:
            self.evict = jax.jit(self._traced("evict", self._evict_impl), donate_argnums=0, static_argnums=2,
                                  out_shardings=(state_sh, self.parked_sharding()))
            self.resume = jax.jit(self._traced("resume", self._resume_impl), donate_argnums=1,
                                   out_shardings=state_sh)

    def _traced(self, name: str, fn):
        """``fn`` counting its traces in ``self.traces[name]`` and tracing under the "gen" activation rules."""
        def traced(*args):
            self.traces[name] += 1
            with activation_sharding(self._mesh, "gen"):
                return fn(*args)

        return traced

    def state_shardings(self) -> DecodeState:
        rep = self.replicated
        cache = self.pool_sharding if self.paged else self.cache_sharding
        caches = tuple((cache, cache) for _ in range(self.cfg.num_layers))
        pages = paged.PageTable(rep, rep, rep, rep) if self.paged else None
        return DecodeState(caches, rep, rep, rep, rep, Requests(*[rep] * len(Requests._fields)), pages)

    def parked_sharding(self) -> Parked:
        rep = self.replicated
        caches = tuple((self.pool_sharding, self.pool_sharding) for _ in range(self.cfg.num_layers))
        return Parked(caches, rep, rep, rep, rep, Requests(*[rep] * len(Requests._fields)))

    def _unstack_impl(self, params):
        if self.adapters is not None:  # LoRA: W + scale * A @ B in float32, then cast (merge_lora)
            params = merge_lora(params, self.adapters)
        return decode.unstack_layers(jax.tree.map(lambda x: x.astype(self.dtype), params))

    def _init_state_impl(self):
        s = self._slots
        if self.paged:
            shape = (self.kv_pages, self.kv_heads, self.page_size, self.cfg.head_dim)
            caches = tuple((jnp.zeros(shape, self.dtype), jnp.zeros(shape, self.dtype))
                           for _ in range(self.cfg.num_layers))
            pages = paged.empty_table(s, self.pages_per_slot, self.kv_pages)
        else:
            caches = decode.empty_caches(self.cfg, s, self.max_target_length, self.kv_heads, self.dtype)
            pages = None
        requests = jax.tree.map(jnp.asarray, make_requests(s, self.max_stop_tokens))
        zeros = jnp.zeros((s,), jnp.int32)
        return DecodeState(caches, zeros, zeros, zeros, jnp.zeros((s,), bool), requests, pages)

    def _empty_prefix_impl(self, rows):
        return decode.empty_caches(self.cfg, rows, 0, self.kv_heads, self.dtype)

    def _prefill_impl(self, params, tokens_bt, true_b, start_b, base, requests, num_samples):
        rows, t = tokens_bt.shape
        grow = lambda c: jnp.concatenate([c, jnp.zeros(c.shape[:2] + (t,) + c.shape[3:], c.dtype)], axis=2)  # noqa: E731
        caches = tuple((grow(k), grow(v)) for k, v in base)
        hidden, caches, *routes = decode.run(params, self.cfg, tokens_bt, start_b, caches, only_b=true_b - 1,
                                             record_routes=self.record_routes)
        logits = decode.logits(params, hidden[:, 0])
        per_sample = jax.tree.map(lambda x: jnp.repeat(x, num_samples, axis=0), requests)
        per_sample = per_sample._replace(sample=jnp.tile(jnp.arange(num_samples, dtype=jnp.int32), rows))
        tokens, logprobs = sample_blocks(logits, per_sample, jnp.zeros((rows * num_samples,), jnp.int32),
                                         repeat=num_samples)
        done = _is_done(tokens, jnp.ones_like(tokens), per_sample)
        shape = (rows, num_samples)
        tokens, logprobs, done = tokens.reshape(shape), logprobs.reshape(shape), done.reshape(shape)
        prefix = Prefix(caches, start_b + true_b, tokens, logprobs, requests)
        ones = jnp.ones(shape, jnp.int32)
        return prefix, ResultTokens(tokens, logprobs, ones.astype(bool), ones, done, *routes)

    def _insert_impl(self, prefix, state, slot, row, sample_index):
        def place(cache, new):
            new = jax.lax.dynamic_slice_in_dim(new, row, 1, axis=0)
            return jax.lax.dynamic_update_slice(cache, new, (slot, 0, 0, 0))

        caches = tuple((place(k, pk), place(v, pv)) for (k, v), (pk, pv) in zip(state.caches, prefix.caches,
                                                                                   strict=True))
        request = jax.tree.map(lambda x: x[row], prefix.requests)._replace(sample=sample_index)
        requests = jax.tree.map(lambda s, r: s.at[slot].set(r), state.requests, request)
        token = prefix.first_tokens[row, sample_index]
        done = _is_done(token[None], jnp.ones((1,), jnp.int32), jax.tree.map(lambda x: x[None], request))[0]
        return DecodeState(caches, state.tokens.at[slot].set(token), state.lengths.at[slot].set(prefix.lengths[row]),
                           state.steps.at[slot].set(1), state.active.at[slot].set(~done), requests)

    def _insert_many_impl(self, prefix, state, slots, rows, samples):
        length = prefix.caches[0][0].shape[2]

        def place(cache, new):  # entries with slot = max_concurrent_decodes are padding: dropped
            return cache.at[slots, :, :length, :].set(new[rows], mode="drop")

        caches = tuple((place(k, pk), place(v, pv)) for (k, v), (pk, pv) in zip(state.caches, prefix.caches,
                                                                                   strict=True))
        request = jax.tree.map(lambda x: x[rows], prefix.requests)._replace(sample=samples)
        requests = jax.tree.map(lambda s, r: s.at[slots].set(r, mode="drop"), state.requests, request)
        tokens = prefix.first_tokens[rows, samples]
        done = _is_done(tokens, jnp.ones_like(tokens), request)
        put = lambda x, v: x.at[slots].set(v, mode="drop")  # noqa: E731
        return DecodeState(caches, put(state.tokens, tokens), put(state.lengths, prefix.lengths[rows]),
                           put(state.steps, jnp.ones_like(tokens)), put(state.active, ~done), requests)

    def _paged_insert_impl(self, prefix, state, slots, rows, samples):
        """``insert_many`` on pages: entry i's prefix row takes ceil(length / page_size) fresh pages (none
        when its first token ends it); an entry the pool cannot hold leaves its slot empty."""
        request = jax.tree.map(lambda x: x[rows], prefix.requests)._replace(sample=samples)
        tokens = prefix.first_tokens[rows, samples]
        lengths = prefix.lengths[rows]
        done = _is_done(tokens, jnp.ones_like(tokens), request)
        rows_caches = tuple((k[rows], v[rows]) for k, v in prefix.caches)
        caches, pages, placed = paged.place(state.caches, state.pages, rows_caches, slots, jnp.where(done, 0, lengths))
        requests = jax.tree.map(lambda x, r: x.at[slots].set(r, mode="drop"), state.requests, request)
        put = lambda x, v: x.at[slots].set(v, mode="drop")  # noqa: E731
        return DecodeState(caches, put(state.tokens, tokens), put(state.lengths, lengths),
                           put(state.steps, jnp.ones_like(tokens)), put(state.active, placed), requests, pages)

    def _prefill_slots_impl(self, params, state, slots, tokens_bt, true_b, requests):
        """Row b's tokens prefilled onto the cache in slot ``slots[b]`` (from its length on), its first token
        drawn, and the slot made live with the row's request; rows whose slot is out of range are padding
        (nothing changes). The window is each row's whole slot and zeros past its end (at least t, so a padded
        chunk never overruns it: a clamped write would land on earlier positions), one width for every call of
        a shape, so the programs are one per (rows, t) bucket; attention reads it only up to the longest real
        row's length + tokens (``decode.run``'s ``span``), so a call costs what its rows hold. Rows are read one
        slice each (XLA:CPU's gathers of whole windows are far slower) and only the new positions are written
        back, in place (a write of whole windows read from the same buffer made XLA copy every cache)."""
        rows, t = tokens_bt.shape
        start = state.lengths[jnp.minimum(slots, self._slots - 1)]
        cut = self.max_target_length
        block = decode.span_block(cut + t)
        width = -(-(cut + t) // block) * block
        positions = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]  # [rows, t] the tokens' places

        def rows_of(c):  # [rows, kv, width, head_dim]; a padding row reads the last slot (clamped)
            out = jnp.concatenate([jax.lax.dynamic_slice(c, (slots[b], 0, 0, 0), (1,) + c.shape[1:2] + (cut,)
                                                         + c.shape[3:]) for b in range(rows)])
            return jnp.concatenate([out, jnp.zeros(out.shape[:2] + (width - cut,) + out.shape[3:], out.dtype)], axis=2)

        def back(c, new):  # only the tokens' keys / values; padding rows and places past the slot are dropped
            fresh = jnp.take_along_axis(new, positions[:, None, :, None], axis=2).transpose(0, 2, 1, 3)
            return c.at[slots[:, None], :, positions, :].set(fresh, mode="drop")

        # the windows are read before any cache is written (else XLA copies every cache to write it in place)
        old, cache_in = jax.lax.optimization_barrier((tuple((rows_of(k), rows_of(v)) for k, v in state.caches),
                                                      state.caches))
        span = jnp.max(jnp.where(slots < self._slots, start + true_b, 0))
        hidden, new, *routes = decode.run(params, self.cfg, tokens_bt, start, old, only_b=true_b - 1,
                                          record_routes=self.record_routes, span=span)
        tokens, logprobs = sample_blocks(decode.logits(params, hidden[:, 0]), requests, jnp.zeros((rows,), jnp.int32))
        done = _is_done(tokens, jnp.ones_like(tokens), requests)
        caches = tuple((back(k, nk), back(v, nv)) for (k, v), (nk, nv) in zip(cache_in, new, strict=True))
        put = lambda x, v: x.at[slots].set(v, mode="drop")  # noqa: E731
        state = DecodeState(caches, put(state.tokens, tokens), put(state.lengths, start + true_b),
                            put(state.steps, jnp.ones_like(tokens)), put(state.active, ~done),
                            jax.tree.map(put, state.requests, requests))
        ones = jnp.ones((rows, 1), jnp.int32)
        return state, ResultTokens(tokens[:, None], logprobs[:, None], ones.astype(bool), ones, done[:, None],
                                   *routes)

    def _take_cache_impl(self, state, slot, width):
        """Slot ``slot``'s first ``width`` cache positions, per layer (k, v) [1, kv_heads, width, head_dim]."""
        return tuple(tuple(jax.lax.dynamic_slice(c, (slot, 0, 0, 0), (1, c.shape[1], width, c.shape[3])) for c in kv)
                     for kv in state.caches)

    def _put_cache_impl(self, state, slot, caches, length):
        """``caches`` (as :meth:`_take_cache_impl` returns them) back into slot ``slot``, which holds ``length``
        tokens then and does not decode (a prefill_slots call continues it)."""
        new = tuple(tuple(jax.lax.dynamic_update_slice(c, w, (slot, 0, 0, 0)) for c, w in zip(kv, saved, strict=True))
                    for kv, saved in zip(state.caches, caches, strict=True))
        return state._replace(caches=new, lengths=state.lengths.at[slot].set(length),
                              active=state.active.at[slot].set(False))

    def _evict_impl(self, state, slot, count):
        pages, caches, held = paged.take_out(state.caches, state.pages, slot, count)
        request = jax.tree.map(lambda x: x[slot], state.requests)
        parked = Parked(caches, held, state.tokens[slot], state.lengths[slot], state.steps[slot], request)
        return state._replace(active=state.active.at[slot].set(False), pages=pages), parked

    def _resume_impl(self, parked, state, slot):
        caches, pages, placed = paged.put_back(state.caches, state.pages, slot, parked.caches, parked.held)
        requests = jax.tree.map(lambda x, r: x.at[slot].set(r), state.requests, parked.request)
        return DecodeState(caches, state.tokens.at[slot].set(parked.token), state.lengths.at[slot].set(parked.length),
                           state.steps.at[slot].set(parked.steps), state.active.at[slot].set(placed), requests, pages)

    def _generate_impl(self, params, state, items=None):
        if self.paged:
            return self._paged_generate_impl(params, state, items)
        positions = jnp.minimum(state.lengths, self.max_target_length - 1)
        hidden, caches, *routes = decode.run(params, self.cfg, state.tokens[:, None], positions, state.caches,
                                             record_routes=self.record_routes)
        tokens, logprobs = sample_blocks(decode.logits(params, hidden[:, 0]), state.requests, state.steps)
        active = state.active
        steps = state.steps + active
        done = active & _is_done(tokens, steps, state.requests)
        new = DecodeState(caches, jnp.where(active, tokens, state.tokens), state.lengths + active, steps,
                          active & ~done, state.requests)
        return new, ResultTokens(tokens, logprobs, active, steps, done, *(r[:, 0] for r in routes))

    def _paged_generate_impl(self, params, state, items):
        """A decode step on pages: a slot whose position starts a page takes one (or, with none free, sits
        this step out), attention reads the slots' pages, finished slots give theirs back."""
        positions = jnp.minimum(state.lengths, self.max_target_length - 1)
        active = state.active
        pages, run, write = paged.grow(state.pages, positions, active, self.page_size)
        work = paged.work_items(pages, positions, run, items, self.page_size)
        hidden, caches, *routes = decode.run_paged(params, self.cfg, state.tokens, positions, state.caches, write,
                                                   work, record_routes=self.record_routes)
        tokens, logprobs = sample_blocks(decode.logits(params, hidden[:, 0]), state.requests, state.steps)
        steps = state.steps + run
        done = run & _is_done(tokens, steps, state.requests)
        new = DecodeState(caches, jnp.where(run, tokens, state.tokens), state.lengths + run, steps, active & ~done,
                          state.requests, paged.release_if_any(pages, done))
        return new, ResultTokens(tokens, logprobs, run, steps, done, *(r[:, 0] for r in routes))

    def _generate_steps_impl(self, params, state, items=None):
        k, s = self.decode_steps_per_call, self._slots
        zeros = lambda dtype: jnp.zeros((k, s), dtype)  # noqa: E731
        routes = (jnp.zeros((k, s, self.cfg.num_layers, self.cfg.num_experts_per_tok), jnp.int32),) \
            if self.record_routes else ()
        empty = ResultTokens(zeros(jnp.int32), zeros(jnp.float32), zeros(bool), zeros(jnp.int32), zeros(bool),
                             *routes)

        def more(carry):
            i, state, _ = carry
            return (i < k) & jnp.any(state.active)

        def step(carry):
            i, state, out = carry
            state, result = self._generate_impl(params, state, items)
            return i + 1, state, jax.tree.map(lambda buf, x: buf.at[i].set(x), out, result)

        _, state, out = jax.lax.while_loop(more, step, (jnp.int32(0), state, empty))
        return state, out


def _is_done(tokens_n, steps_n, requests: Requests) -> jax.Array:
    stopped = jnp.any(tokens_n[:, None] == requests.stop, axis=-1)
    return stopped | (steps_n >= requests.limit)


def _drop_layer_axis(sharding: NamedSharding) -> NamedSharding:
    return NamedSharding(sharding.mesh, PartitionSpec(*tuple(sharding.spec)[1:]))
