"""Mini-batch PPO updates (trainer.mini_batches x trainer.ppo_epochs): one program makes the updates one after
another from the generating policy's log-probs, so the first update's ratio is 1 and the later ones' are not;
clipping changes the gradient only where the ratio leaves the clip range; the planner prices the updates;
compile-ahead and checkpoint resume keep working."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec
from jobs import job_for, tiny_config, tiny_job

from nereus_jax.config import AlgorithmConfig, ModelConfig
from nereus_jax.elastic.costs import CostModel, StageChoice
from nereus_jax.elastic.hardware import get_hardware
from nereus_jax.elastic.workload import Workload, WorkloadError
from nereus_jax.models import init_params
from nereus_jax.runtime.step.job import JobError
from nereus_jax.runtime.step.losses import (
    actor_loss,
    make_minibatch_train_step,
    make_train_step,
    put_minibatches,
    response_logprobs,
    split_micro,
    split_minibatches,
)
from nereus_jax.sharding import Layout, make_mesh

CFG = ModelConfig()
P, R, B = 6, 5, 8


def _batch(seed=0, spread=0.1):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(3, CFG.vocab_size, size=(B, P + R)).astype(np.int32)
    rlen = rng.integers(1, R + 1, size=B)
    resp_mask = (np.arange(R)[None] < rlen[:, None]).astype(np.int32)
    return {"tokens": tokens, "mask": np.concatenate([np.ones((B, P), np.int32), resp_mask], 1),
            "response_mask": resp_mask, "old_logp": rng.normal(-4.9, spread, size=(B, R)).astype(np.float32),
            "advantages": rng.normal(size=(B, R)).astype(np.float32) * resp_mask,
            "ref_logp": rng.normal(-4.9, 0.1, size=(B, R)).astype(np.float32)}


def _with_denominators(batch):
    mask = batch["response_mask"]
    return {**batch, "denom": np.float32(mask.sum()), "seq_denom": np.float32((mask.sum(1) > 0).sum())}


def test_minibatch_program_equals_its_updates_made_one_after_another():
    """2 epochs x 2 mini-batches in one program = 4 single updates on the halves, in order (each half
    normalised by its own tokens and sequences)."""
    params = init_params(CFG, seed=0)
    loss, opt = actor_loss(CFG, AlgorithmConfig(kl_in_reward=False), P), optax.adam(1e-3)
    batch = _batch()
    program = jax.jit(make_minibatch_train_step(loss, opt, CFG, epochs=2))
    got, _, metrics = program(params, opt.init(params), split_minibatches(batch, 2, 1))
    assert metrics["loss"].shape == (4,)
    one = jax.jit(make_train_step(loss, opt, CFG))
    want, state = params, opt.init(params)
    halves = [_with_denominators({k: v[i * B // 2:(i + 1) * B // 2] for k, v in batch.items()}) for i in (0, 1)]
    for half in halves * 2:
        want, state, _ = one(want, state, split_micro(half, 1))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), got, want)


def test_one_minibatch_one_epoch_is_the_single_update():
    params = init_params(CFG, seed=1)
    loss, opt = actor_loss(CFG, AlgorithmConfig(), P), optax.sgd(1.0)
    batch = _batch(1)
    got, _, m = jax.jit(make_minibatch_train_step(loss, opt, CFG))(params, opt.init(params),
                                                                   split_minibatches(batch, 1, 2))
    want, _, w = jax.jit(make_train_step(loss, opt, CFG))(params, opt.init(params),
                                                           split_micro(_with_denominators(batch), 2))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), got, want)
    assert float(m["loss"][0]) == float(w["loss"])


def test_clipping_changes_the_gradient_only_where_the_ratio_leaves_the_clip_range():
    """The clipped loss's parameter gradient equals the unclipped loss's with the advantages of exactly the
    tokens outside the range (in the direction their advantage pushes) set to 0, and differs from the plain
    unclipped gradient: clipping acts on those tokens and nowhere else."""
    params = init_params(CFG, seed=2)
    batch = _with_denominators(_batch(2))
    logp = np.asarray(response_logprobs(params, CFG, batch["tokens"], batch["mask"], P))
    rng = np.random.default_rng(3)
    batch["old_logp"] = (logp + rng.normal(0, 0.3, size=logp.shape)).astype(np.float32)  # ratios 0.5 .. 2
    ratio, adv = np.exp(logp - batch["old_logp"]), batch["advantages"]
    outside = ((ratio > 1.2) & (adv > 0)) | ((ratio < 0.8) & (adv < 0))
    outside &= batch["response_mask"] > 0
    assert 0 < outside.sum() < batch["response_mask"].sum()

    def grads(algo, data):
        return jax.grad(lambda p: actor_loss(CFG, algo, P)(p, data)[0])(params)

    clipped = grads(AlgorithmConfig(clip_ratio=0.2), batch)
    masked = grads(AlgorithmConfig(clip_ratio=1e9), {**batch, "advantages": np.where(outside, 0.0, adv)})
    plain = grads(AlgorithmConfig(clip_ratio=1e9), batch)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5), clipped, masked)
    diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(clipped), jax.tree.leaves(plain),
                                                              strict=True))
    assert diff > 1e-3


@pytest.fixture(scope="module")
def four_minibatches(warm):
    job = tiny_job(["trainer.mini_batches=4"], actor=warm)
    try:
        yield job, job.step(0).metrics
    finally:
        job.close()


def test_first_minibatch_ratio_is_one_and_later_ones_move_away_and_get_clipped(four_minibatches):
    """old_logp are actor-infer's, before any update: the first mini-batch's ratio is 1 (to float rounding:
    actor-infer's and the train step's forwards are the same function on other batch shapes), the three later
    ones see the policy the earlier updates made, so their ratios leave 1 and the clipping acts."""
    _, m = four_minibatches
    per = m["actor_per_update"]
    assert len(per["ratio_max"]) == 4 and len(m["critic_per_update"]["grad_norm"]) == 4
    assert abs(per["ratio_max"][0] - 1) <= 1e-5 and abs(per["ratio_min"][0] - 1) <= 1e-5
    assert per["clip_fraction"][0] == 0.0
    for u in (1, 2, 3):
        assert max(per["ratio_max"][u] - 1, 1 - per["ratio_min"][u]) > 1e-3, per
    assert max(per["clip_fraction"][1:]) > 0 and m["clip_fraction"] > 0
    assert m["ratio_max"] == max(per["ratio_max"]) and m["ratio_min"] == min(per["ratio_min"])
    for key in ("approx_kl", "clip_fraction", "ratio_mean", "mismatch_kl", "mismatch_ratio_max",
                "mismatch_outside_fraction"):
        assert np.isfinite(m[key]), key


def test_minibatches_split_the_batch_in_token_budget_micro_batches(four_minibatches):
    """16 x 2 rows in 4 mini-batches of 8 on dp 8 (one row per replica per mini-batch); the token budget is
    applied inside a mini-batch: a budget of one row still runs (one micro-batch of 1 row per replica)."""
    job, _ = four_minibatches
    assert job.mini_rows == 8 and job.stages.accum("train", 8) == 1 and job.stages.accum("infer", 8) == 1
    keys = [k for k in job.stages.programs if k[0] == "train"]
    assert keys and all(k[4] == 1 for k in keys)


def test_a_plan_whose_dp_does_not_divide_a_minibatch_is_rejected():
    cfg = tiny_config(["trainer.mini_batches=8"])  # mini-batches of 4 rows on dp 8
    with pytest.raises(JobError, match="trainer.mini_batches"):
        job_for(cfg)


@pytest.mark.parametrize("hardware", ["h100", "cpu"])
def test_the_cost_model_prices_minibatches_times_epochs_training_passes(hardware):
    """actor-train with 4 mini-batches x 2 epochs of a 256-row step costs 8 single-update steps of 64 rows (each
    its calls, optimizer update and gradient all-reduce); scoring stages and memory do not change."""
    cfg, cost = ModelConfig(), CostModel(get_hardware(hardware))
    four = Workload.fixed(64, 32, 32, samples_per_prompt=4, mini_batches=4, epochs=2)
    quarter = Workload.fixed(16, 32, 32, samples_per_prompt=4)
    for mb in (2, 8):  # 4 calls or 1 call per mini-batch and replica
        choice = StageChoice(1, 1, 8, mb)
        np.testing.assert_allclose(cost.stage_latency(cfg, "actor-train", choice, four).total,
                                   8 * cost.stage_latency(cfg, "actor-train", choice, quarter).total, rtol=1e-12)
        assert cost.stage_memory(cfg, "actor-train", choice, four) == cost.stage_memory(cfg, "actor-train", choice,
                                                                                         quarter)
    one = Workload.fixed(64, 32, 32, samples_per_prompt=4)
    choice = StageChoice(1, 1, 8, 8)
    assert cost.stage_latency(cfg, "ref-infer", choice, four) == cost.stage_latency(cfg, "ref-infer", choice, one)
    assert four.updates == 8 and four.train_sequences == 64
    with pytest.raises(WorkloadError, match="mini_batches"):
        Workload.fixed(3, 8, 8, mini_batches=2)


def test_the_planner_splits_only_minibatches_over_dp():
    from nereus_jax.elastic.planner import Planner

    cfg = ModelConfig()
    wl = Workload.fixed(8, 16, 16, samples_per_prompt=2, mini_batches=4)  # 16 rows, mini-batches of 4
    result = Planner(CostModel(get_hardware("h100"))).plan(cfg, "grpo", wl, tuple(range(8)))
    train = result.plan[next(ms for ms in result.plan if str(ms) == "actor-train")]
    assert 4 % train.dp == 0


def test_an_announced_leave_with_minibatches_is_compiled_ahead(tmp_path):
    """prepare() compiles the mini-batch training program for the target plan from the recorded signatures:
    the step after the move compiles nothing new."""
    from nereus_jax.runtime.control.adapt import Adapter

    job = tiny_job(["trainer.mini_batches=2", "cluster.schedule=[{step: 3, leave: [7], notice: 2}]"])
    adapter = Adapter(job, log=lambda _: None)
    try:
        metrics = None
        for s in range(4):
            adapter.boundary(s, metrics)
            if adapter.pending is not None:
                adapter.pending.future.result()
            before = dict(job.stages.programs)
            metrics = job.step(s).metrics
            if adapter.transitions:
                break
    finally:
        adapter.close()
        job.close()
    assert adapter.transitions == 1 and 7 not in job.plan.devices
    assert job.stages.programs == before


def test_minibatch_rows_are_placed_on_the_replicas_they_belong_to(devices):
    """split_minibatches + put_minibatches: mini-batch m, micro-batch a, replica d holds rows in order."""
    mesh = make_mesh(devices[:4], Layout(1), dp=4)
    data = {"response_mask": np.ones((16, 2), np.int32), "x": np.arange(16 * 2).reshape(16, 2)}
    placed = put_minibatches(split_minibatches(data, 2, 2), mesh)
    assert placed["x"].shape == (2, 2, 4, 2) and placed["denom"].shape == (2, 2)
    assert placed["x"].sharding == NamedSharding(mesh, PartitionSpec(None, None, "dp"))
    np.testing.assert_array_equal(np.asarray(placed["x"]).reshape(16, 2), data["x"])
    np.testing.assert_array_equal(np.asarray(placed["denom"]), 16.0)
