"""Advantage estimators and losses of PPO, GRPO, ReMax and RLOO, chosen by name from registries.

Conventions: responses are right-padded, ``[b, t]`` arrays with ``mask_bt`` = 1 on real response tokens.
Every reduction over tokens goes through :func:`masked_mean`, so padding never changes a result.
Sequence-level scores are ``[b]``; grouped algorithms see ``b = prompts x samples_per_prompt`` with a
prompt's samples adjacent (rows ``p*n .. p*n+n-1``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

_EPS = 1e-6


def masked_mean(x: jax.Array, mask: jax.Array, axis=None, denom=None) -> jax.Array:
    """Mean of ``x`` over positions where ``mask`` is 1 (0 where there are none). With ``denom``, the
    masked sum over ``denom`` instead: micro-batches that share the whole batch's token count as ``denom``
    sum to exactly the whole batch's mean, however the batch is split."""
    mask = mask.astype(x.dtype)
    total = jnp.sum(x * mask, axis=axis)
    return total / (jnp.maximum(jnp.sum(mask, axis=axis), 1.0) if denom is None else denom)


def masked_whiten(x: jax.Array, mask: jax.Array) -> jax.Array:
    """(x - mean) / std over real tokens; padding positions come out 0."""
    mean = masked_mean(x, mask)
    var = masked_mean(jnp.square(x - mean), mask)
    return (x - mean) * jax.lax.rsqrt(var + 1e-8) * mask


# ------------------------------------------------------------------------------------------ advantages
class Advantages(NamedTuple):
    advantages_bt: jax.Array
    returns_bt: jax.Array  # value targets (PPO); equal to advantages for critic-free estimators


def gae(rewards_bt: jax.Array, values_bt: jax.Array, mask_bt: jax.Array, gamma: float, lam: float) -> Advantages:
    """Generalised advantage estimation over each response (bootstrap 0 past the last real token)."""
    mask = mask_bt.astype(jnp.float32)
    values = values_bt * mask
    next_values = jnp.concatenate([values[:, 1:], jnp.zeros_like(values[:, :1])], axis=1)
    deltas = rewards_bt * mask + gamma * next_values - values
    next_mask = jnp.concatenate([mask[:, 1:], jnp.zeros_like(mask[:, :1])], axis=1)

    def step(carry, xs):
        delta, nmask = xs
        adv = delta + gamma * lam * nmask * carry
        return adv, adv

    _, adv = jax.lax.scan(step, jnp.zeros(rewards_bt.shape[0]), (deltas.T, next_mask.T), reverse=True)
    adv = adv.T * mask
    return Advantages(adv, (adv + values) * mask)


def _grouped(scores_b: jax.Array, n: int) -> jax.Array:
    if scores_b.shape[0] % n:
        raise ValueError(f"{scores_b.shape[0]} scores do not split into groups of samples_per_prompt={n}")
    return scores_b.reshape(-1, n)


def grpo(scores_b: jax.Array, mask_bt: jax.Array, n: int) -> Advantages:
    """Group-normalised advantages: (score - group mean) / (group std + eps), std unbiased (ddof=1)."""
    g = _grouped(scores_b, n)
    adv = (g - g.mean(axis=1, keepdims=True)) / (jnp.std(g, axis=1, keepdims=True, ddof=1) + _EPS)
    return _broadcast(adv.reshape(-1), mask_bt)


def rloo(scores_b: jax.Array, mask_bt: jax.Array, n: int) -> Advantages:
    """Leave-one-out baseline: score minus the mean of the other samples of the same prompt."""
    g = _grouped(scores_b, n)
    baseline = (g.sum(axis=1, keepdims=True) - g) / (n - 1)
    return _broadcast((g - baseline).reshape(-1), mask_bt)


def remax(scores_b: jax.Array, mask_bt: jax.Array, baseline_b: jax.Array) -> Advantages:
    """ReMax: score minus the score of the greedy response to the same prompt."""
    return _broadcast(scores_b - baseline_b, mask_bt)


def _broadcast(adv_b: jax.Array, mask_bt: jax.Array) -> Advantages:
    adv = adv_b[:, None] * mask_bt.astype(jnp.float32)
    return Advantages(adv, adv)


# -------------------------------------------------------------------------------------- KL and losses
def kl_estimate(logp_bt: jax.Array, ref_logp_bt: jax.Array, estimator: str) -> jax.Array:
    """Per-token KL(pi || ref) estimates from sampled tokens: k1 = log ratio, k3 = exp(-r) + r - 1."""
    log_ratio = logp_bt - ref_logp_bt
    if estimator == "k1":
        return log_ratio
    if estimator == "k3":
        return jnp.exp(-log_ratio) + log_ratio - 1.0
    raise ValueError(f"unknown KL estimator {estimator!r}; expected 'k1' or 'k3'")


def token_rewards(scores_b: jax.Array, mask_bt: jax.Array, kl_bt: jax.Array | None, kl_coef: float) -> jax.Array:
    """Sequence score on the last real token, minus kl_coef x KL on every token (the PPO reward)."""
    mask = mask_bt.astype(jnp.float32)
    last = jnp.maximum(jnp.sum(mask, axis=1).astype(jnp.int32) - 1, 0)
    rewards = jax.nn.one_hot(last, mask.shape[1]) * scores_b[:, None] * (jnp.sum(mask, axis=1, keepdims=True) > 0)
    if kl_bt is not None:
        rewards = rewards - kl_coef * kl_bt
    return rewards * mask


class PolicyLoss(NamedTuple):
    loss: jax.Array
    clip_fraction: jax.Array
    approx_kl: jax.Array


def ppo_policy_loss(logp_bt, old_logp_bt, adv_bt, mask_bt, clip_ratio: float, denom=None) -> PolicyLoss:
    """Clipped surrogate: mean over tokens of max(-A r, -A clip(r, 1-eps, 1+eps)) (see masked_mean's denom)."""
    log_ratio = logp_bt - old_logp_bt
    ratio = jnp.exp(log_ratio)
    unclipped = -adv_bt * ratio
    clipped = -adv_bt * jnp.clip(ratio, 1.0 - clip_ratio, 1.0 + clip_ratio)
    loss = masked_mean(jnp.maximum(unclipped, clipped), mask_bt, denom=denom)
    clip_fraction = masked_mean((clipped > unclipped).astype(jnp.float32), mask_bt, denom=denom)
    return PolicyLoss(loss, clip_fraction, masked_mean(-log_ratio, mask_bt, denom=denom))


def value_loss(values_bt, old_values_bt, returns_bt, mask_bt, value_clip: float, denom=None) -> jax.Array:
    """Clipped value loss: 0.5 x mean over tokens of max((v - R)^2, (v_clip - R)^2)."""
    clipped = old_values_bt + jnp.clip(values_bt - old_values_bt, -value_clip, value_clip)
    err = jnp.maximum(jnp.square(values_bt - returns_bt), jnp.square(clipped - returns_bt))
    return 0.5 * masked_mean(err, mask_bt, denom=denom)


def entropy_from_logits(logits_btv: jax.Array) -> jax.Array:
    """Per-token entropy of the softmax distribution, [b, t]."""
    logp = jax.nn.log_softmax(logits_btv.astype(jnp.float32), axis=-1)
    return -jnp.sum(jnp.exp(logp) * logp, axis=-1)


def token_logprobs(logits_btv: jax.Array, tokens_bt: jax.Array) -> jax.Array:
    """log p(token) under the logits, [b, t] (float32)."""
    logp = jax.nn.log_softmax(logits_btv.astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(logp, tokens_bt[..., None], axis=-1)[..., 0]


# ------------------------------------------------------------------------------------------ registry
class AlgorithmSpec(NamedTuple):
    advantage: str            # name in ADVANTAGES
    uses_critic: bool         # trains a value model (critic-infer, critic-train stages)
    needs_group: bool         # needs samples_per_prompt >= 2
    needs_greedy_baseline: bool


ADVANTAGES: dict[str, Callable[..., Advantages]] = {"gae": gae, "grpo": grpo, "rloo": rloo, "remax": remax}

ALGORITHMS: dict[str, AlgorithmSpec] = {
    "ppo": AlgorithmSpec("gae", uses_critic=True, needs_group=False, needs_greedy_baseline=False),
    "grpo": AlgorithmSpec("grpo", uses_critic=False, needs_group=True, needs_greedy_baseline=False),
    "rloo": AlgorithmSpec("rloo", uses_critic=False, needs_group=True, needs_greedy_baseline=False),
    "remax": AlgorithmSpec("remax", uses_critic=False, needs_group=False, needs_greedy_baseline=True),
}


def algorithm_spec(name: str) -> AlgorithmSpec:
    """The registered algorithm ``name``; unknown names list the registered ones."""
    if name not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {name!r}; registered: {sorted(ALGORITHMS)}")
    return ALGORITHMS[name]
