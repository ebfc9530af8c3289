"""What a mixture-of-experts forward reports about its routing, and the losses and metrics built on it.

A forward asked for it (``forward(..., return_routing=True)``) returns a :class:`RouterStats` beside its
output: per layer, how many token-expert pairs went to each expert and the router's softmax summed over the
counted tokens (attention mask 1, or a packed segment), and, given recorded routes (routing replay), which
tokens were routed to other experts than the record names (none under replay: the record is what routes them)
and which tokens the router's own top-k disagrees with the record on. The layer scan emits one :func:`layer_stats` per
layer; a pipeline sums its stages' and micro-batches' (they add up).

:func:`load_balancing_loss` is transformers' ``load_balancing_loss_func`` (Qwen3-MoE's auxiliary loss,
Switch Transformer's eq. 4 pooled over layers) on those sums::

    loss = E * sum_e f_e * P_e,  f_e = pairs routed to e / (layers * tokens),  P_e = mean softmax of e

Only ``P`` carries a gradient (``f`` counts a top-k), so the loss pushes the router's probabilities toward the
experts that are under-used. Routes are recorded and replayed as ``[batch, length, layers, k]`` integer
arrays, -1 where nothing was recorded (:data:`NO_ROUTE`).

    logits, stats = forward(params, cfg, tokens_bt, attention_mask_bt=mask, return_routing=True)
    aux = load_balancing_loss(stats)
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from nereus_jax.models.layers import Routed, same_experts

NO_ROUTE = -1  # a token whose routes were not recorded (padding, or the last token of a response)


class RouterStats(NamedTuple):
    """Routing of one forward (or the sum of several: counts and probability sums add up)."""

    counts_le: jax.Array  # [layers, experts] float32: token-expert pairs routed to each expert, counted tokens
    probs_le: jax.Array   # [layers, experts] float32: the router's softmax summed over the counted tokens
    tokens: jax.Array     # [] float32: tokens counted per layer
    # given recorded routes, [b, t] bool each (tokens without a record: False): the experts the forward used
    # differ from the recorded set in at least one layer (never under replay), and the router's own top-k does
    mismatch_bt: jax.Array | None = None
    own_mismatch_bt: jax.Array | None = None


def route_dtype(num_experts: int) -> np.dtype:
    """The integer type recorded routes are kept in: int16 (experts below 32,768, and -1 for no record)."""
    assert num_experts < 2**15, num_experts
    return np.dtype(np.int16)


def layer_stats(routed: Routed, token_mask_bt: jax.Array, recorded_btk: jax.Array | None
                ) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """One layer's (counts [experts], probability sums [experts], mismatch [b, t, 2] or None) over the tokens
    where ``token_mask_bt`` is 1: the mismatch of the experts used, then of the router's own top-k, with the
    recorded ones. Counts read the experts used (replayed ones under replay)."""
    num_experts = routed.probs.shape[-1]
    mask = token_mask_bt.astype(jnp.float32)
    onehot = jax.nn.one_hot(routed.experts, num_experts, dtype=jnp.float32).sum(axis=-2)  # [b, t, experts]
    counts = jnp.einsum("bte,bt->e", onehot, mask)
    probs = jnp.einsum("bte,bt->e", routed.probs, mask)
    if recorded_btk is None:
        return counts, probs, None
    has = jnp.all(recorded_btk >= 0, axis=-1)
    differ = [has & ~same_experts(experts, recorded_btk) for experts in (routed.experts, routed.own)]
    return counts, probs, jnp.stack(differ, axis=-1)


def with_mismatch(counts_le: jax.Array, probs_le: jax.Array, tokens: jax.Array,
                  mismatch_bt2: jax.Array | None) -> RouterStats:
    """RouterStats from the layer statistics' sums (the mismatch [b, t, 2] already OR-ed over layers)."""
    if mismatch_bt2 is None:
        return RouterStats(counts_le, probs_le, tokens)
    return RouterStats(counts_le, probs_le, tokens, mismatch_bt2[..., 0], mismatch_bt2[..., 1])


def load_balancing_loss(stats: RouterStats) -> jax.Array:
    """transformers' ``load_balancing_loss_func`` (without its coefficient) from a forward's router statistics:
    ``experts * sum_e f_e * P_e`` pooled over layers and counted tokens (module docstring)."""
    num_layers, num_experts = stats.counts_le.shape
    total = jnp.maximum(stats.tokens * num_layers, 1.0)
    f = jax.lax.stop_gradient(stats.counts_le.sum(0)) / total
    p = stats.probs_le.sum(0) / total
    return num_experts * jnp.sum(f * p)
