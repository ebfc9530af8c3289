"""Advantages, losses, aggregations and rollout corrections against hand-computed cases and direct loops;
padding changes nothing; each algorithm resolves its published defaults."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nereus_jax.config import AlgorithmConfig
from nereus_jax.rl.algorithms import (
    LOSS_AGGS,
    aggregate,
    algorithm_spec,
    behaviour_ratio,
    correction_weights,
    dr_grpo,
    entropy_from_logits,
    gae,
    grpo,
    importance_log_ratio,
    informative_groups,
    kl_estimate,
    masked_mean,
    mismatch_metrics,
    overlong_penalty,
    policy_loss,
    ppo_policy_loss,
    remax,
    rloo,
    settings,
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
    assert algorithm_spec("dapo").dynamic_sampling and algorithm_spec("gspo").ratio_level == "sequence"
    with pytest.raises(ValueError, match="registered"):
        algorithm_spec("dpo")


# ------------------------------------------------------------------ issue 22: aggregation, variants, corrections
def test_aggregation_modes_give_the_published_normalisers():
    """Rows of 3 and 1 real tokens (R = 4): token-mean (DAPO) = 10 / 4 tokens; seq-mean-token-mean (GRPO paper)
    = (6/3 + 4/1) / 2 sequences; seq-mean-token-sum-norm (Dr.GRPO) = (6/4 + 4/4) / 2; a row without a real token
    counts in none of them."""
    x = jnp.array([[1.0, 2.0, 3.0, 9.0], [4.0, 9.0, 9.0, 9.0], [7.0, 7.0, 7.0, 7.0]])
    mask = jnp.array([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    assert float(aggregate(x, mask, "token-mean")) == 2.5
    assert float(aggregate(x, mask, "seq-mean-token-mean")) == 3.0
    assert float(aggregate(x, mask, "seq-mean-token-sum-norm")) == 1.25
    with pytest.raises(ValueError, match="token-mean"):
        aggregate(x, mask, "sum")


@pytest.mark.parametrize("mode", LOSS_AGGS)
def test_micro_batches_sharing_the_batch_normalisers_sum_to_the_whole_batch(mode):
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(6, 5)))
    mask = jnp.asarray((np.arange(5)[None] < np.array([5, 2, 0, 3, 1, 4])[:, None]).astype(np.int32))
    denom, seq_denom = jnp.sum(mask).astype(x.dtype), jnp.float32(5.0)
    parts = [aggregate(x[i:i + 2], mask[i:i + 2], mode, denom, seq_denom) for i in (0, 2, 4)]
    np.testing.assert_allclose(float(sum(parts)), float(aggregate(x, mask, mode)), rtol=1e-6)


def test_dr_grpo_centres_on_the_group_mean_without_dividing_by_the_std():
    adv = np.asarray(dr_grpo(jnp.array([1.0, 0.0, 0.0, 0.0, 2.0, 4.0, 6.0, 8.0]), jnp.ones((8, 2)), n=4)
                     .advantages_bt[:, 0])
    np.testing.assert_allclose(adv, [0.75, -0.25, -0.25, -0.25, -3.0, -1.0, 1.0, 3.0])


def test_asymmetric_clipping_raises_only_the_upper_bound():
    """DAPO's clip-higher (low 0.2, high 0.28): ratios 0.7 (A<0, clipped at 0.8), 0.85 (inside), 1.25 (inside
    1.28, but clipped at 1.2 with the symmetric 0.2) and 1.3 (clipped at 1.28)."""
    logp, old = jnp.log(jnp.array([[0.7, 0.85, 1.25, 1.3]])), jnp.zeros((1, 4))
    adv, mask = jnp.array([[-1.0, -1.0, 1.0, 1.0]]), jnp.ones((1, 4))
    dapo = policy_loss(logp, old, adv, mask, 0.2, 0.28)
    np.testing.assert_allclose(float(dapo.loss), (0.8 + 0.85 - 1.25 - 1.28) / 4, rtol=1e-6)
    np.testing.assert_allclose(float(dapo.clip_fraction), 0.5)
    symmetric = policy_loss(logp, old, adv, mask, 0.2, 0.2)
    np.testing.assert_allclose(float(symmetric.loss), (0.8 + 0.85 - 1.2 - 1.2) / 4, rtol=1e-6)
    np.testing.assert_allclose(float(symmetric.clip_fraction), 0.75)
    assert float(dapo.ratio_max) == pytest.approx(1.3) and float(dapo.ratio_min) == pytest.approx(0.7)


def test_clipping_zeroes_the_gradient_only_where_the_ratio_leaves_the_range_in_the_direction_of_a():
    """d loss / d logp: -A r / T for tokens inside the range or moving back into it, 0 for tokens outside it in
    the direction the advantage pushes (r > 1.2 with A > 0, r < 0.8 with A < 0)."""
    ratios = jnp.array([[0.5, 0.9, 1.1, 1.5, 0.5, 1.5]])
    adv = jnp.array([[1.0, 1.0, 1.0, 1.0, -1.0, -1.0]])
    mask, old = jnp.ones((1, 6)), jnp.zeros((1, 6))
    grad = jax.grad(lambda lp, eps: policy_loss(lp, old, adv, mask, eps, eps).loss)
    clipped = np.asarray(grad(jnp.log(ratios), 0.2))[0]
    unclipped = np.asarray(grad(jnp.log(ratios), 1e9))[0]
    np.testing.assert_allclose(unclipped, -np.asarray(adv * ratios)[0] / 6, rtol=1e-6)
    outside = np.array([False, False, False, True, True, False])
    np.testing.assert_array_equal(clipped[outside], 0.0)
    np.testing.assert_allclose(clipped[~outside], unclipped[~outside], rtol=1e-6)


def test_gspo_ratio_is_the_geometric_mean_of_the_token_ratios():
    token_ratios = np.array([[1.1, 0.9, 1.2, 7.0], [1.05, 1.0, 1.0, 1.0]])
    mask = jnp.array([[1, 1, 1, 0], [1, 0, 0, 0]])
    log_r = importance_log_ratio(jnp.log(jnp.asarray(token_ratios)), jnp.zeros((2, 4)), mask, "sequence")
    want = [(1.1 * 0.9 * 1.2) ** (1 / 3), 1.05]
    np.testing.assert_allclose(np.exp(np.asarray(log_r))[0, :3], want[0], rtol=1e-6)
    np.testing.assert_allclose(np.exp(np.asarray(log_r))[1, 0], want[1], rtol=1e-6)


def test_gspo_gradient_is_the_sequence_ratio_times_the_mean_token_gradient_and_clips_whole_sequences():
    """GSPO's gradient of -A s_i: -A s_i / |y_i| on each token of row i (seq-mean over 2 rows: / 2 again);
    a row whose s_i leaves [1 - low, 1 + high] in A's direction gets none, on every token."""
    lp = jnp.log(jnp.array([[1.1, 0.9, 1.2, 1.0], [1.5, 1.5, 1.0, 1.0]]))
    mask, adv = jnp.array([[1, 1, 1, 0], [1, 1, 0, 0]]), jnp.ones((2, 4))
    grad = jax.grad(lambda x: policy_loss(x, jnp.zeros((2, 4)), adv, mask, 0.2, 0.2, agg="seq-mean-token-mean",
                                          level="sequence").loss)(lp)
    s0 = (1.1 * 0.9 * 1.2) ** (1 / 3)
    np.testing.assert_allclose(np.asarray(grad)[0], [-s0 / 3 / 2] * 3 + [0.0], rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(grad)[1], 0.0)  # s_1 = 1.5 > 1.2 with A > 0: clipped


def test_overlong_penalty_is_zero_then_linear_over_the_buffer():
    np.testing.assert_allclose(overlong_penalty(np.array([3, 6, 7, 8]), 8, 2, 1.0), [0.0, 0.0, -0.5, -1.0])
    np.testing.assert_allclose(overlong_penalty(np.array([8, 10]), 8, 4, 0.5), [-0.5, -0.5])
    assert not overlong_penalty(np.array([8]), 8, 0, 1.0).any()


def test_informative_groups_are_those_whose_samples_score_differently():
    np.testing.assert_array_equal(informative_groups(np.array([1, 1, 0, 1, 0, 0, 0.5, 0.5]), 2),
                                  [False, True, False, False])


def test_tis_truncates_and_icepop_masks_outside_the_band():
    r = np.array([[0.3, 0.9, 1.5, 3.0, 6.0]])
    np.testing.assert_allclose(correction_weights(r, "tis", 0.5, 2.0), [[0.3, 0.9, 1.5, 2.0, 2.0]])
    np.testing.assert_allclose(correction_weights(r, "icepop", 0.5, 5.0), [[0.0, 0.9, 1.5, 3.0, 0.0]])
    np.testing.assert_array_equal(correction_weights(r, "none", 0.5, 5.0), 1.0)


def test_mismatch_metrics_of_a_hand_computed_case():
    """log-prob gaps log 2 and 0 on two real tokens (a third is padding): k3 = ((2 - 1 - log 2) + 0) / 2."""
    old, behaviour, mask = np.array([[np.log(2.0), -1.0, 5.0]]), np.array([[0.0, -1.0, 0.0]]), np.array([[1, 1, 0]])
    m = mismatch_metrics(old, behaviour, mask, 0.5, 1.5)
    np.testing.assert_allclose(m["mismatch_kl"], (1 - np.log(2.0)) / 2, rtol=1e-12)
    assert m["mismatch_ratio_max"] == pytest.approx(2.0) and m["mismatch_outside_fraction"] == 0.5
    np.testing.assert_allclose(behaviour_ratio(old, behaviour, mask), [[2.0, 1.0, 1.0]])
    assert mismatch_metrics(old, old, mask, 0.5, 1.5) == {"mismatch_kl": 0.0, "mismatch_ratio_max": 1.0,
                                                          "mismatch_outside_fraction": 0.0}


@pytest.mark.parametrize("name,agg,low,high,level,dynamic,buffer", [
    ("ppo", "token-mean", 0.2, 0.2, "token", False, 0),
    ("grpo", "token-mean", 0.2, 0.2, "token", False, 0),
    ("rloo", "token-mean", 0.2, 0.2, "token", False, 0),
    ("remax", "token-mean", 0.2, 0.2, "token", False, 0),
    ("dapo", "token-mean", 0.2, 0.28, "token", True, 20),
    ("dr_grpo", "seq-mean-token-sum-norm", 0.2, 0.2, "token", False, 0),
    ("gspo", "seq-mean-token-mean", 3e-4, 4e-4, "sequence", False, 0),
])
def test_each_algorithm_resolves_its_published_defaults(name, agg, low, high, level, dynamic, buffer):
    s = settings(AlgorithmConfig(name=name), max_response_length=100)
    assert (s.loss_agg, s.clip_low, s.clip_high, s.ratio_level, s.dynamic_sampling, s.overlong_buffer) == \
        (agg, low, high, level, dynamic, buffer)
    assert (s.correction_low, s.correction_clip) == (0.5, 2.0)


def test_explicit_keys_override_the_algorithm_defaults():
    s = settings(AlgorithmConfig(name="dapo", clip_ratio_high=0.3, loss_agg="seq-mean-token-mean",
                                 dynamic_sampling=False, overlong_buffer=0, rollout_correction="icepop"), 100)
    assert (s.clip_low, s.clip_high, s.loss_agg, s.dynamic_sampling, s.overlong_buffer) == \
        (0.2, 0.3, "seq-mean-token-mean", False, 0)
    assert s.correction_clip == 5.0
