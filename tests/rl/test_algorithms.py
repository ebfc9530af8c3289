"""Advantages and losses against hand-computed cases and direct loops; padding changes nothing."""

import jax.numpy as jnp
import numpy as np
import pytest

from nereus_jax.rl.algorithms import (
    algorithm_spec,
    entropy_from_logits,
    gae,
    grpo,
    kl_estimate,
    masked_mean,
    ppo_policy_loss,
    remax,
    rloo,
    token_logprobs,
    token_rewards,
    value_loss,
)


def _gae_loop(rewards, values, length, gamma, lam):
    adv = np.zeros(length)
    last = 0.0
    for t in reversed(range(length)):
        next_v = values[t + 1] if t + 1 < length else 0.0
        delta = rewards[t] + gamma * next_v - values[t]
        last = delta + gamma * lam * last
        adv[t] = last
    return adv


@pytest.mark.smoke
def test_gae_matches_a_direct_loop_per_row_and_ignores_padding():
    rng = np.random.default_rng(0)
    rewards, values = rng.normal(size=(3, 7)), rng.normal(size=(3, 7))
    lengths = [7, 4, 1]
    mask = (np.arange(7)[None] < np.array(lengths)[:, None]).astype(np.float32)
    out = gae(jnp.asarray(rewards), jnp.asarray(values), jnp.asarray(mask), 0.9, 0.8)
    for i, n in enumerate(lengths):
        ref = _gae_loop(rewards[i], values[i], n, 0.9, 0.8)
        np.testing.assert_allclose(np.asarray(out.advantages_bt[i, :n]), ref, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(out.returns_bt[i, :n]), ref + values[i, :n], rtol=1e-5, atol=1e-6)
        assert np.all(np.asarray(out.advantages_bt[i, n:]) == 0)
    garbage = np.where(mask > 0, rewards, 1e3), np.where(mask > 0, values, -1e3)
    again = gae(jnp.asarray(garbage[0]), jnp.asarray(garbage[1]), jnp.asarray(mask), 0.9, 0.8)
    np.testing.assert_array_equal(np.asarray(again.advantages_bt), np.asarray(out.advantages_bt))


def test_grpo_normalises_within_each_group_with_unbiased_std():
    scores = jnp.array([1.0, 0.0, 0.0, 0.0, 2.0, 4.0])
    mask = jnp.ones((6, 3))
    adv = np.asarray(grpo(scores, mask, n=3).advantages_bt[:, 0])
    g1 = np.array([1.0, 0, 0])
    np.testing.assert_allclose(adv[:3], (g1 - g1.mean()) / (g1.std(ddof=1) + 1e-6), rtol=1e-5)
    np.testing.assert_allclose(adv[3:], [-1.0, 0.0, 1.0], rtol=1e-5)  # mean 2, std 2


def test_grpo_group_of_equal_scores_gives_zero_advantage():
    adv = grpo(jnp.ones(4), jnp.ones((4, 2)), n=4).advantages_bt
    assert np.all(np.asarray(adv) == 0)


def test_rloo_baseline_is_the_mean_of_the_other_samples():
    adv = np.asarray(rloo(jnp.array([1.0, 2.0, 6.0]), jnp.ones((3, 1)), n=3).advantages_bt[:, 0])
    np.testing.assert_allclose(adv, [1 - 4, 2 - 3.5, 6 - 1.5])


def test_remax_subtracts_the_greedy_score_on_real_tokens_only():
    mask = jnp.array([[1, 1, 0], [1, 0, 0]])
    adv = np.asarray(remax(jnp.array([1.0, 0.0]), mask, jnp.array([0.5, 0.5])).advantages_bt)
    np.testing.assert_allclose(adv, [[0.5, 0.5, 0], [-0.5, 0, 0]])


def test_grouped_advantages_reject_batches_that_do_not_split_into_groups():
    with pytest.raises(ValueError, match="samples_per_prompt=4"):
        grpo(jnp.ones(6), jnp.ones((6, 1)), n=4)


def test_ppo_clipping_at_the_boundary():
    old = jnp.zeros((1, 4))
    # ratios 1.1 (inside), 1.2 (at the boundary), 1.5 (clipped for A>0), 0.5 (clipped for A<0)
    logp = jnp.log(jnp.array([[1.1, 1.2, 1.5, 0.5]]))
    adv = jnp.array([[1.0, 1.0, 1.0, -1.0]])
    out = ppo_policy_loss(logp, old, adv, jnp.ones((1, 4)), clip_ratio=0.2)
    expected = np.mean([-1.1, -1.2, -1.2, 0.8])
    np.testing.assert_allclose(float(out.loss), expected, rtol=1e-6)
    np.testing.assert_allclose(float(out.clip_fraction), 0.5)


def test_ppo_loss_ignores_padding_tokens():
    logp, old, adv = jnp.array([[0.1, -0.3, 9.0]]), jnp.zeros((1, 3)), jnp.array([[1.0, -2.0, 50.0]])
    mask = jnp.array([[1, 1, 0]])
    full = ppo_policy_loss(logp, old, adv, mask, 0.2).loss
    trimmed = ppo_policy_loss(logp[:, :2], old[:, :2], adv[:, :2], mask[:, :2], 0.2).loss
    assert float(full) == float(trimmed)


def test_value_loss_clips_to_the_old_value_neighbourhood():
    loss = value_loss(jnp.array([[3.0]]), jnp.array([[0.0]]), jnp.array([[1.0]]), jnp.ones((1, 1)), 0.2)
    np.testing.assert_allclose(float(loss), 0.5 * max((3 - 1) ** 2, (0.2 - 1) ** 2))


def test_kl_estimators():
    logp, ref = jnp.array([-1.0]), jnp.array([-2.0])
    assert float(kl_estimate(logp, ref, "k1")[0]) == 1.0
    np.testing.assert_allclose(float(kl_estimate(logp, ref, "k3")[0]), np.exp(-1.0) + 1.0 - 1.0, rtol=1e-6)
    assert float(kl_estimate(ref, ref, "k3")[0]) == 0.0
    with pytest.raises(ValueError, match="k2"):
        kl_estimate(logp, ref, "k2")


def test_token_rewards_put_the_score_on_the_last_real_token_minus_kl():
    mask = jnp.array([[1, 1, 1, 0], [1, 0, 0, 0]])
    kl = jnp.full((2, 4), 0.5)
    r = np.asarray(token_rewards(jnp.array([2.0, -1.0]), mask, kl, kl_coef=0.1))
    np.testing.assert_allclose(r, [[-0.05, -0.05, 1.95, 0], [-1.05, 0, 0, 0]], rtol=1e-6)


def test_entropy_and_logprobs_of_a_uniform_distribution():
    logits = jnp.zeros((1, 2, 4))
    np.testing.assert_allclose(np.asarray(entropy_from_logits(logits)), np.log(4.0), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(token_logprobs(logits, jnp.array([[0, 3]]))), np.log(0.25), rtol=1e-6)


def test_masked_mean_of_an_empty_mask_is_zero():
    assert float(masked_mean(jnp.ones(3), jnp.zeros(3))) == 0.0


def test_registry_names_algorithms_and_rejects_unknown():
    assert algorithm_spec("ppo").uses_critic and not algorithm_spec("grpo").uses_critic
    assert algorithm_spec("grpo").needs_group and algorithm_spec("remax").needs_greedy_baseline
    with pytest.raises(ValueError, match="registered"):
        algorithm_spec("dpo")
