"""JetStream's engine contract, declared here (we do not depend on the archived package): the verbs of
``jetstream.engine.engine_api.Engine`` with their meaning, and the data they pass (:class:`Prefix`,
:class:`DecodeState`, :class:`ResultTokens`), plus our :class:`Parked` (a sequence taken out of a paged
engine's slot). :class:`~nereus_jax.engine.engine.JaxEngine` implements it."""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol, runtime_checkable

import jax
from jax.sharding import Mesh

from nereus_jax.engine import decode, paged
from nereus_jax.engine.sampling import Requests

Params = Any  # what load_params returns: the model's tree with per-layer weights, laid out on the mesh


class EngineError(ValueError):
    """A request the engine cannot serve (prompt too long, bad slot, ...); the message says what to change."""


class ResultTokens(NamedTuple):
    """One token per slot (generate) or per prompt row and sample (prefill: [rows, n])."""

    tokens: jax.Array  # int32
    logprobs: jax.Array  # float32: log_softmax(logits / temperature) at the token
    valid: jax.Array  # bool: the slot was live, so the token is real
    lengths: jax.Array  # int32: tokens the slot has generated, this one included
    done: jax.Array  # bool: this token ended the slot (stop token or token limit)
    # engines that record routes (mixture-of-experts models): the router's top-k per layer of the tokens the
    # call ran through the model, int32. generate: [slots, layers, k] of the token each slot was fed (the one
    # drawn before this one); prefill: [rows, t, layers, k] of the prompt's tokens (past true_length: padding)
    routes: jax.Array | None = None


class Prefix(NamedTuple):
    """Prefilled prompts: their KV caches, lengths, first tokens and requests (one row per prompt)."""

    caches: decode.LayerCaches  # per layer (k, v) [rows, kv_heads, length, head_dim]
    lengths: jax.Array  # [rows] tokens in the cache
    first_tokens: jax.Array  # [rows, n]
    first_logprobs: jax.Array  # [rows, n]
    requests: Requests  # per row


class DecodeState(NamedTuple):
    """Everything the decode loop carries, one entry per slot."""

    caches: decode.LayerCaches  # per layer (k, v) [slots, kv_heads, max_target_length, head_dim]
    tokens: jax.Array  # [slots] the last token drawn, fed in at the next step
    lengths: jax.Array  # [slots] tokens in the cache = the position of `tokens`
    steps: jax.Array  # [slots] tokens generated so far = the response index of the next one
    active: jax.Array  # [slots] bool
    requests: Requests  # per slot
    pages: paged.PageTable | None = None  # paged engines: the page table; caches are then per-layer pools
    # [kv_pages, kv_heads, page_size, head_dim]


class Parked(NamedTuple):
    """A sequence taken out of its slot by :meth:`JaxEngine.evict`: its pages and decoding state."""

    caches: decode.LayerCaches  # per layer (k, v) [pages, kv_heads, page_size, head_dim]; the first `held` count
    held: jax.Array  # [] int32 pages the sequence holds
    token: jax.Array  # [] the token fed at its next step
    length: jax.Array  # [] tokens in its cache
    steps: jax.Array  # [] tokens generated so far
    request: Requests  # its request (scalars)


@runtime_checkable
class Engine(Protocol):
    """JetStream's engine contract (names and meaning of ``jetstream.engine.engine_api.Engine``)."""

    def prefill(self, *, params: Params, existing_prefix: Prefix | None = None, padded_tokens: jax.Array,
                true_length: int) -> tuple[Prefix, ResultTokens]:
        """Computes a prompt's KV cache (after ``existing_prefix`` if given) and samples its first token."""

    def generate(self, params: Params, decode_state: DecodeState) -> tuple[DecodeState, ResultTokens]:
        """One token for every slot of the decode state."""

    def insert(self, prefix: Prefix, decode_state: DecodeState, slot: int) -> DecodeState:
        """Places a prefix in a decode slot."""

    def load_params(self, *args, **kwargs) -> Params:
        """Parameters laid out for this engine."""

    def init_decode_state(self, *args, **kwargs) -> DecodeState:
        """An empty decode state."""

    def get_prefix_destination_sharding(self) -> Any:
        """The shardings a prefix must have to be inserted."""

    def get_tokenizer(self) -> Any:
        """The tokenizer (or its parameters) this engine serves with."""

    @property
    def max_concurrent_decodes(self) -> int: ...

    @property
    def max_prefill_length(self) -> int: ...

    @property
    def samples_per_slot(self) -> int: ...

    @property
    def mesh(self) -> Mesh: ...
