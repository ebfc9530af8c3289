"""Advantage estimators, losses and rollout corrections of PPO, GRPO, ReMax, RLOO, DAPO, Dr.GRPO and GSPO,
chosen by name from registries (:data:`ALGORITHMS`, in ``rl.registry``, holds each algorithm's defaults).

Conventions: responses are right-padded, ``[b, t]`` arrays with ``mask_bt`` = 1 on real response tokens.
Every reduction over tokens goes through :func:`masked_mean` or :func:`aggregate`, so padding never changes
a result. Sequence-level scores are ``[b]``; grouped algorithms see ``b = prompts x samples_per_prompt``
with a prompt's samples adjacent (rows ``p*n .. p*n+n-1``).

Loss aggregation (``algorithm.loss_agg``, verl's ``loss_agg_mode``) over a (mini-)batch of B sequences
with lengths L_i, per-token losses l_it and R = rollout.max_response_length:

- ``token-mean`` (DAPO): sum_it l_it / sum_i L_i
- ``seq-mean-token-mean`` (the GRPO paper): (1/B) sum_i (1/L_i) sum_t l_it
- ``seq-mean-token-sum-norm`` (Dr.GRPO): (1/B) sum_i (1/R) sum_t l_it, a constant normaliser

Sequences without a real token (masked out) are not counted in B.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from nereus_jax.rl.registry import ALGORITHMS as ALGORITHMS  # re-exported (the registry itself is jax-free)
from nereus_jax.rl.registry import AlgorithmSpec, algorithm_spec

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


LOSS_AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def aggregate(x_bt: jax.Array, mask_bt: jax.Array, mode: str, denom=None, seq_denom=None) -> jax.Array:
    """Per-token values reduced to one loss by ``mode`` (see the module docstring). ``denom`` (tokens) and
    ``seq_denom`` (sequences with a real token) are the whole (mini-)batch's, so micro-batches that share
    them sum to exactly the whole (mini-)batch's loss; None: this batch's own."""
    if mode == "token-mean":
        return masked_mean(x_bt, mask_bt, denom=denom)
    mask = mask_bt.astype(x_bt.dtype)
    sums, lengths = jnp.sum(x_bt * mask, axis=1), jnp.sum(mask, axis=1)
    if seq_denom is None:
        seq_denom = jnp.maximum(jnp.sum(lengths > 0), 1).astype(x_bt.dtype)
    if mode == "seq-mean-token-mean":
        return jnp.sum(sums / jnp.maximum(lengths, 1.0)) / seq_denom
    if mode == "seq-mean-token-sum-norm":
        return jnp.sum(sums / x_bt.shape[1]) / seq_denom
    raise ValueError(f"unknown loss aggregation {mode!r}; expected one of {LOSS_AGGS}")


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


def dr_grpo(scores_b: jax.Array, mask_bt: jax.Array, n: int) -> Advantages:
    """Dr.GRPO: score minus the group mean, without dividing by the group's std (its difficulty bias)."""
    g = _grouped(scores_b, n)
    return _broadcast((g - g.mean(axis=1, keepdims=True)).reshape(-1), mask_bt)


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
    ratio_mean: jax.Array | float = 1.0
    ratio_max: jax.Array | float = 1.0  # over real tokens, and 1 (a batch without tokens gives 1)
    ratio_min: jax.Array | float = 1.0


def importance_log_ratio(logp_bt: jax.Array, old_logp_bt: jax.Array, mask_bt: jax.Array, level: str) -> jax.Array:
    """log(pi / pi_old) per token: the token's own (``token``), or GSPO's sequence-level, length-normalised
    ratio s_i = exp(mean_t log ratio) on every token of row i (``sequence``), written as sg(log s_i) +
    logp - sg(logp) so that its gradient is s_i x grad log pi per token, averaged over the sequence by the
    ``seq-mean-token-mean`` aggregation: GSPO's gradient."""
    log_ratio = logp_bt - old_logp_bt
    if level == "token":
        return log_ratio
    assert level == "sequence", level
    seq = masked_mean(log_ratio, mask_bt, axis=1)[:, None]
    return jax.lax.stop_gradient(seq) + logp_bt - jax.lax.stop_gradient(logp_bt)


def policy_loss(logp_bt, old_logp_bt, adv_bt, mask_bt, clip_low: float, clip_high: float, *, agg="token-mean",
                level="token", denom=None, seq_denom=None) -> PolicyLoss:
    """Clipped surrogate max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)) per token, aggregated by ``agg``
    (:func:`aggregate`); ``level`` picks the ratio (:func:`importance_log_ratio`). ``clip_fraction`` is the
    share of tokens whose clipped term is the larger one (their gradient is zero); ``approx_kl`` the mean of
    -log r (k1 of KL(pi_old || pi)); both and the ratio statistics are token means over the batch."""
    log_ratio = importance_log_ratio(logp_bt, old_logp_bt, mask_bt, level)
    ratio = jnp.exp(log_ratio)
    unclipped = -adv_bt * ratio
    clipped = -adv_bt * jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = aggregate(jnp.maximum(unclipped, clipped), mask_bt, agg, denom, seq_denom)
    clip_fraction = masked_mean((clipped > unclipped).astype(jnp.float32), mask_bt, denom=denom)
    real = mask_bt > 0
    return PolicyLoss(loss, clip_fraction, masked_mean(-log_ratio, mask_bt, denom=denom),
                      masked_mean(ratio, mask_bt, denom=denom), jnp.max(jnp.where(real, ratio, 1.0)),
                      jnp.min(jnp.where(real, ratio, 1.0)))


def ppo_policy_loss(logp_bt, old_logp_bt, adv_bt, mask_bt, clip_ratio: float, denom=None) -> PolicyLoss:
    """Clipped surrogate: mean over tokens of max(-A r, -A clip(r, 1-eps, 1+eps)) (see masked_mean's denom)."""
    return policy_loss(logp_bt, old_logp_bt, adv_bt, mask_bt, clip_ratio, clip_ratio, denom=denom)


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


# ------------------------------------------------------------------------- sampling and reward shaping
def informative_groups(scores_b: np.ndarray, n: int) -> np.ndarray:
    """[groups] bool: the prompt's n samples do not all score the same (DAPO's dynamic sampling keeps these;
    a group of equal scores has zero group-relative advantage, so no gradient)."""
    g = np.asarray(scores_b).reshape(-1, n)
    return g.max(axis=1) > g.min(axis=1)


def overlong_penalty(lengths_b: np.ndarray, max_length: int, buffer: int, factor: float) -> np.ndarray:
    """DAPO's soft overlong punishment, added to the reward: 0 up to ``max_length - buffer`` tokens, then
    falling linearly to ``-factor`` at ``max_length`` (and beyond); 0 everywhere when ``buffer`` is 0."""
    if buffer <= 0:
        return np.zeros(np.shape(lengths_b), np.float32)
    over = np.asarray(lengths_b, np.float32) - (max_length - buffer)
    return (-factor * np.clip(over / buffer, 0.0, 1.0)).astype(np.float32)


# ---------------------------------------------------------------------- rollout vs train mismatch
def behaviour_ratio(old_logp_bt: np.ndarray, behaviour_logp_bt: np.ndarray, mask_bt: np.ndarray) -> np.ndarray:
    """pi_old / pi_behaviour per token (actor-infer's log-probs over the engine's); 1 on padding."""
    log_ratio = (np.asarray(old_logp_bt, np.float64) - np.asarray(behaviour_logp_bt, np.float64)) * mask_bt
    return np.exp(log_ratio)


def correction_weights(ratio_bt: np.ndarray, mode: str, low: float, high: float) -> np.ndarray:
    """Per-token weights on the policy loss for the rollout/train mismatch: ``none`` 1; ``tis`` (truncated
    importance sampling, Yao et al.) min(r, high); ``icepop`` r inside [low, high] and 0 outside (the token is
    masked: no gradient). Non-negative, so they can scale the advantages (the clipped objective is linear in
    a non-negative weight on A)."""
    if mode == "none":
        return np.ones_like(ratio_bt)
    if mode == "tis":
        return np.minimum(ratio_bt, high)
    if mode == "icepop":
        return np.where((ratio_bt >= low) & (ratio_bt <= high), ratio_bt, 0.0)
    raise ValueError(f"unknown rollout correction {mode!r}; expected none, tis or icepop")


def mismatch_metrics(old_logp_bt, behaviour_logp_bt, mask_bt, low: float, high: float) -> dict[str, float]:
    """How far the engine's log-probs are from actor-infer's on the sampled tokens: ``mismatch_kl`` (the k3
    estimate of KL(pi_behaviour || pi_old), >= 0), ``mismatch_ratio_max`` (the largest pi_old / pi_behaviour)
    and ``mismatch_outside_fraction`` (tokens whose ratio leaves [low, high])."""
    mask = np.asarray(mask_bt) > 0
    if not mask.any():
        return {"mismatch_kl": 0.0, "mismatch_ratio_max": 1.0, "mismatch_outside_fraction": 0.0}
    log_ratio = (np.asarray(old_logp_bt, np.float64) - np.asarray(behaviour_logp_bt, np.float64))[mask]
    ratio = np.exp(log_ratio)
    return {"mismatch_kl": float(np.mean(ratio - 1.0 - log_ratio)), "mismatch_ratio_max": float(ratio.max()),
            "mismatch_outside_fraction": float(np.mean((ratio < low) | (ratio > high)))}


# ------------------------------------------------------------------------------------------ registry
ADVANTAGES: dict[str, Callable[..., Advantages]] = {"gae": gae, "grpo": grpo, "dr_grpo": dr_grpo, "rloo": rloo,
                                                    "remax": remax}

CORRECTION_CLIP = {"none": 2.0, "tis": 2.0, "icepop": 5.0}  # Yao et al.'s TIS cap; IcePop's band [0.5, 5]


class Settings(NamedTuple):
    """An ``algorithm`` config section with every null key replaced by its algorithm's default."""

    spec: AlgorithmSpec
    loss_agg: str
    clip_low: float
    clip_high: float
    ratio_level: str
    dynamic_sampling: bool
    overlong_buffer: int
    correction_low: float
    correction_clip: float


def settings(algo, max_response_length: int) -> Settings:
    """The resolved settings of ``algo`` (an AlgorithmConfig) for responses of ``max_response_length``."""
    spec = algorithm_spec(algo.name)
    pick = lambda given, default: default if given is None else given  # noqa: E731
    buffer = math.floor(spec.overlong_buffer_fraction * max_response_length)
    return Settings(spec, pick(algo.loss_agg, spec.loss_agg),
                    pick(algo.clip_ratio_low, pick(spec.clip_ratio_low, algo.clip_ratio)),
                    pick(algo.clip_ratio_high, pick(spec.clip_ratio_high, algo.clip_ratio)), spec.ratio_level,
                    pick(algo.dynamic_sampling, spec.dynamic_sampling), pick(algo.overlong_buffer, buffer),
                    algo.correction_low, pick(algo.correction_clip, CORRECTION_CLIP[algo.rollout_correction]))
