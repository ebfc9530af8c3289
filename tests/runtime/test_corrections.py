"""Rollout vs train mismatch and the other off-policy pieces in the running job: the engine's log-probs are
compared with actor-infer's every step (bf16 generation: a mismatch; float32 on one layout: none), TIS and
IcePop change the update exactly as their weights say, staleness reweighting composes with them in the
documented order, a transition logs the mismatch before and after it, DAPO's dynamic sampling keeps the batch
size exact and stops at its cap, and a resumed run computes what a straight run computes."""

import types

import jax
import numpy as np
import pytest
from jobs import restore_for, tiny_config, tiny_job

from nereus_jax.model_stage import ACTOR_TRAIN
from nereus_jax.rl import algorithms as alg
from nereus_jax.rl.batch import RolloutBatch
from nereus_jax.rl.rewards import RewardBatch, Rewarder
from nereus_jax.runtime.step.job import EXTRA_INDEX_OFFSET
from nereus_jax.runtime.step.learner import Learner

BF16 = ["model.compute_dtype=bfloat16", "algorithm.name=grpo"]


def _actor(job):
    return job.units[ACTOR_TRAIN][0].to_host()["params"]


# ------------------------------------------------------------------------------------ the composition order
def _corrector(mode, stale_rollouts="reweight", importance_clip=2.0, low=0.5, high=None):
    cfg = tiny_config([f"algorithm.rollout_correction={mode}", f"algorithm.correction_low={low}",
                       f"trainer.stale_rollouts={stale_rollouts}", f"trainer.importance_clip={importance_clip}"]
                      + ([f"algorithm.correction_clip={high}"] if high else []))
    return types.SimpleNamespace(cfg=cfg, settings=alg.settings(cfg.algorithm, 8))


RATIOS = np.array([0.3, 1.0, 1.5, 3.0, 6.0])


def _weights(corrector, stale):
    """The weight per token the job puts on the advantages (all 1 before), row 0 fresh, row 1 stale."""
    old = np.log(np.stack([RATIOS, RATIOS, RATIOS])).astype(np.float32)
    mask = np.array([[1, 1, 1, 1, 1], [1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], np.int32)
    zeros = np.zeros((3, 5), np.int32)
    batch = RolloutBatch(zeros, zeros, zeros, mask, np.zeros((3, 5), np.float32), np.zeros(3), np.zeros(3),
                         np.zeros(3, np.int32))
    adv = alg.Advantages(np.ones((3, 5), np.float32) * mask, np.ones((3, 5), np.float32))
    out, metrics = Learner.correct(corrector, adv, batch, old * mask, np.array(stale))
    return np.asarray(out.advantages_bt), metrics


@pytest.mark.parametrize("mode,stale_rollouts,fresh,stale", [
    ("none", "reweight", [1, 1, 1, 1, 1], [0.3, 1, 1.2, 1.2, 1.2]),
    ("tis", "reweight", [0.3, 1, 1.5, 2, 2], [0.3, 1, 1.2, 1.2, 1.2]),
    ("icepop", "reweight", [0, 1, 1.5, 3, 0], [0, 1, 1.2, 1.2, 0]),
    ("tis", "drop", [0.3, 1, 1.5, 2, 2], [0.3, 1, 1.5, 2, 2]),  # drop masks rows before; no reweighting here
])
def test_corrections_compose_in_the_documented_order(mode, stale_rollouts, fresh, stale):
    """One weight per token from r = pi_old / pi_behaviour: the correction on every row (tis min(r, 2), icepop
    r in [0.5, 5] else 0), then on stale rows min(r, importance_clip) instead (icepop's masked tokens stay 0);
    padding stays 0."""
    w, metrics = _weights(_corrector(mode, stale_rollouts, importance_clip=1.2), [0, 1, 1])
    np.testing.assert_allclose(w[0], fresh, rtol=1e-6)
    np.testing.assert_allclose(w[1], stale, rtol=1e-6)
    np.testing.assert_array_equal(w[2, 3:], 0.0)
    assert metrics["mismatch_ratio_max"] == pytest.approx(6.0)
    assert ("importance_weight_mean" in metrics) == (stale_rollouts == "reweight")


def test_no_correction_on_fresh_rows_leaves_the_advantages_untouched():
    adv = alg.Advantages(np.ones((3, 5), np.float32), np.ones((3, 5), np.float32))
    corrector = _corrector("none")
    batch = RolloutBatch(*(np.zeros((3, 5), np.int32),) * 3, np.ones((3, 5), np.int32), np.zeros((3, 5), np.float32),
                         np.zeros(3), np.zeros(3), np.zeros(3, np.int32))
    out, metrics = Learner.correct(corrector, adv, batch, np.full((3, 5), -0.1, np.float32), np.zeros(3))
    assert out is adv and metrics["mismatch_kl"] > 0 and metrics["mismatch_outside_fraction"] == 0.0


# --------------------------------------------------------------------------------------- mismatch in the job
@pytest.fixture(scope="module")
def bf16_runs(warm):
    """Step 0 of the same warm actor four times with bf16 generation: no correction; TIS capped at 1.0 (so the
    truncation acts on every token with r > 1); IcePop with a narrow band; and no correction with the TIS
    weights computed here from the batch, by hand."""
    tis, icepop = ["algorithm.rollout_correction=tis", "algorithm.correction_clip=1.0"], \
        ["algorithm.rollout_correction=icepop", "algorithm.correction_low=0.995", "algorithm.correction_clip=1.005"]
    out = {}
    for name, extra in (("none", []), ("tis", tis), ("icepop", icepop)):
        job = tiny_job(BF16 + extra, actor=warm)
        out[name] = (job.step(0), _actor(job))
        job.close()
    job = tiny_job(BF16, actor=warm)
    advantages = job.learner.advantages

    def by_hand(step, batch, scores, scored):
        adv = advantages(step, batch, scores, scored)
        r = np.exp(scored["old_logp"].astype(np.float64) - batch.behaviour_logp_br.astype(np.float64))
        w = (np.minimum(r, 1.0) * batch.response_mask_br).astype(np.float32)
        return alg.Advantages(np.asarray(adv.advantages_bt) * w, adv.returns_bt)

    job.learner.advantages = by_hand
    out["by_hand"] = (job.step(0), _actor(job))
    job.close()
    return out


def test_bf16_generation_shows_a_mismatch_every_step(bf16_runs):
    m = bf16_runs["none"][0].metrics
    assert 1e-8 < m["mismatch_kl"] < 1e-2 and m["mismatch_ratio_max"] > 1.0 + 1e-4
    assert 0.0 <= m["mismatch_outside_fraction"] <= 1.0
    narrow = bf16_runs["icepop"][0].metrics
    assert narrow["mismatch_outside_fraction"] > 0 and narrow["correction_masked_fraction"] == \
        pytest.approx(narrow["mismatch_outside_fraction"])


def test_tis_and_icepop_change_the_update_as_specified(bf16_runs):
    """The same rollouts in all four; TIS trains exactly like no correction on hand-weighted advantages, and
    TIS and IcePop each move the parameters somewhere else than no correction."""
    rollouts = [r.batch.response_br for r, _ in bf16_runs.values()]
    assert all(np.array_equal(rollouts[0], x) for x in rollouts[1:])
    none, tis, icepop, by_hand = (bf16_runs[k][1] for k in ("none", "tis", "icepop", "by_hand"))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-7), tis, by_hand)

    def gap(a, b):
        return max(float(np.max(np.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))

    assert gap(tis, none) > 1e-6 and gap(icepop, none) > 1e-6
    assert bf16_runs["tis"][0].metrics["correction_weight_mean"] < 1.0


def test_float32_on_one_layout_has_no_mismatch(warm):
    job = tiny_job(["plan.default.tp=1", "plan.stages.actor-gen.tp=1"], actor=warm)
    try:
        for s in range(2):
            m = job.step(s).metrics
            assert m["mismatch_kl"] < 1e-6 and m["mismatch_ratio_max"] < 1 + 1e-4, m
            assert m["mismatch_outside_fraction"] == 0.0
    finally:
        job.close()


def test_a_transition_logs_the_mismatch_before_and_after_it(warm):
    """bf16 generation, packed sequences; devices 6 and 7 leave at step 1: the move's event holds the mismatch of
    step 0 and of step 1 (the first on the new plan), and the adapter logs both."""
    from nereus_jax.runtime.control.adapt import Adapter

    lines = []
    job = tiny_job(BF16 + ["cluster.schedule=[{step: 1, leave: [6, 7]}]", "trainer.packing=true"], actor=warm)
    adapter = Adapter(job, log=lines.append)
    try:
        metrics = None
        for s in range(3):
            adapter.boundary(s, metrics)
            if s < 2:
                metrics = job.step(s).metrics
    finally:
        adapter.close()
        job.close()
    move = next(e for e in adapter.events if e["event"] == "transition")
    assert move["step"] == 1 and move["mismatch_kl_before"] > 0 and move["mismatch_kl_after"] > 0
    assert move["mismatch_kl_after"] == metrics["mismatch_kl"]
    assert any("rollout/train mismatch across the transition at step 1: mismatch_kl" in x for x in lines), lines


def test_async_corrects_stale_and_fresh_rows_together(warm):
    """trainer.mode=async one-step-off with TIS and packed sequences: stale rows get the staleness weight, every
    step logs the mismatch and the correction; the run is the sync-mode job's order of corrections."""
    from nereus_jax.runtime.control.adapt import Adapter
    from nereus_jax.runtime.run import rl_steps

    job = tiny_job(BF16 + ["plan.colocate=false", "plan.stages.actor-gen.dp=4", "trainer.mode=async",
                           "trainer.max_staleness=1", "algorithm.rollout_correction=tis", "trainer.mini_batches=2",
                           "trainer.packing=true"], actor=warm)
    adapter = Adapter(job, log=lambda _: None)
    try:
        got = [r.metrics for r in rl_steps(job, adapter, 3)]
    finally:
        adapter.close()
        job.close()
    assert [m["rollout_staleness_max"] for m in got] == [0, 1, 1]
    assert "importance_weight_mean" not in got[0] and 0 < got[1]["importance_weight_mean"] <= 2.0
    for m in got:
        assert m["mismatch_kl"] > 0 and m["correction_weight_mean"] > 0
        assert len(m["actor_per_update"]["ratio_max"]) == 2 and 0 < m["packing_fill"] <= 1


# ------------------------------------------------------------------------------------------ dynamic sampling
class _Scripted(Rewarder):
    """Call i gives the first ``informative[i]`` prompts samples 1, 0, ... (informative), the rest all 0."""

    def __init__(self, informative, n):
        self.informative, self.n, self.calls = list(informative), n, 0

    def score(self, problems, responses):
        k = self.informative[min(self.calls, len(self.informative) - 1)]
        self.calls += 1
        rows = np.arange(len(responses))
        r = ((rows // self.n < k) & (rows % self.n == 0)).astype(np.float32)
        return RewardBatch(r, np.ones(len(r), bool), r >= 1)


def _sample(informative, cap, step=3):
    job = tiny_job(["algorithm.name=dapo", f"algorithm.dynamic_sampling_max_rounds={cap}"],
                   rewarder=_Scripted(informative, 2))
    try:
        problems, positions = job.problems(step)
        batch = job.collect_rollouts(problems, positions, 1.0)
        scores = job.rewards(problems, batch)[0]
        seconds = {"actor-gen": 0.0}
        return job.learner.dynamic_sampling(step, problems, batch, scores, seconds), seconds
    finally:
        job.close()


def test_dynamic_sampling_generates_until_the_batch_is_full_and_keeps_its_size():
    """6 informative prompts a round: rounds 0, 1, 2 give 18 >= 16; the batch is the first 16 of them in round
    order (round r of step 3 reads EXTRA_INDEX_OFFSET + (3 * cap + r - 1) * 16 + i), nothing masked."""
    (problems, batch, scores, m), seconds = _sample([6, 6, 6, 6], cap=4)
    assert m == {"dynamic_sampling_rounds": 2, "dynamic_sampling_filled": 0, "dynamic_sampling_kept_fraction": 18 / 48}
    assert batch.response_br.shape[0] == 32 and len(problems) == 16 and scores.shape == (32,)
    extra = [EXTRA_INDEX_OFFSET + (3 * 4 + r) * 16 + i for r in (0, 1) for i in range(6)][:10]
    np.testing.assert_array_equal(batch.prompt_index_b[::2], [48 + i for i in range(6)] + extra)
    np.testing.assert_array_equal(scores.reshape(16, 2), [[1, 0]] * 16)
    assert (batch.response_mask_br.sum(1) > 0).all() and seconds["actor-gen"] > 0


def test_dynamic_sampling_stops_at_its_cap_and_masks_the_filler():
    """2 informative prompts a round and a cap of 2 extra rounds: 6 kept, 10 dropped prompts fill the batch,
    their rows masked out of the loss."""
    (problems, batch, scores, m), _ = _sample([2, 2, 2, 2, 2], cap=2)
    assert m["dynamic_sampling_rounds"] == 2 and m["dynamic_sampling_filled"] == 10
    assert batch.response_br.shape == (32, 8) and len(problems) == 16
    lengths = batch.response_mask_br.sum(1).reshape(16, 2)
    assert (lengths[:6] > 0).all() and (lengths[6:] == 0).all()


# ------------------------------------------------------------------------------------------------ resume
def test_resume_mid_run_computes_what_a_straight_run_computes(warm, tmp_path):
    """DAPO (dynamic sampling, clip-higher, overlong penalty) with 2 mini-batches x 2 epochs, TIS and packed
    sequences: 4 steps straight vs 2 + checkpoint + restore into a fresh Job + 2, on the same plan: the same
    metrics, bit for bit."""
    from nereus_jax.runtime.durability.checkpoint import Checkpointer

    extra = ["algorithm.name=dapo", "trainer.mini_batches=2", "trainer.ppo_epochs=2",
             "algorithm.rollout_correction=tis", "trainer.packing=true"]
    job = tiny_job(extra, actor=warm)
    ckpt = Checkpointer(str(tmp_path / "ck"), every_steps=2, keep=2)
    straight = []
    for s in range(4):
        straight.append(job.step(s))
        ckpt.maybe_save(job, s + 1)
    ckpt.close()
    job.close()
    resumed_job, meta = restore_for(tiny_config(extra), str(tmp_path / "ck" / "2"))
    try:
        resumed = [resumed_job.step(s) for s in (2, 3)]
    finally:
        resumed_job.close()
    assert meta["step"] == 2
    keys = ("reward_mean", "loss", "policy_loss", "clip_fraction", "approx_kl", "ratio_max", "mismatch_kl",
            "dynamic_sampling_rounds", "overlong_penalty_mean", "correction_weight_mean", "actor_per_update")
    for a, b in zip(resumed, straight[2:], strict=True):
        np.testing.assert_array_equal(a.batch.prompt_index_b, b.batch.prompt_index_b)
        assert {k: a.metrics.get(k) for k in keys} == {k: b.metrics.get(k) for k in keys}
