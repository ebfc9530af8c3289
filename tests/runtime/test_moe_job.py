"""A Qwen3-MoE job end to end on the tiny addition task: GRPO steps (actor-train expert-parallel, ep 2) train
every expert and the router, moves between random plans (ep among them) keep every bit and the job trains on, a
checkpoint resumes into another layout (ep 1, tp 2) bit-exact, and the export is a Qwen3MoeForCausalLM checkpoint
that loads back bit for bit.

Routing replay with bfloat16 generation (float32 training): without replay actor-infer routes some response
tokens to other experts than the engine did (router_mismatch_fraction > 0); with it, none, while its own router
would have disagreed on exactly as many (the same rollouts); the load-balancing loss is logged."""

import json
import random

import numpy as np
import pytest
from jobs import job_for, restore_for, warm_actor
from plans import LAYOUTS, assert_same_state, host_state, move_randomly

from nereus_jax.config import load_config
from nereus_jax.model_stage import ACTOR_TRAIN
from nereus_jax.models.hf import load_hf
from nereus_jax.runtime.durability.checkpoint import Checkpointer
from nereus_jax.runtime.durability.export import export_actor
from nereus_jax.runtime.step.initial_plan import plan_from_config
from nereus_jax.runtime.step.learner import busiest_expert_share
from nereus_jax.sharding import Layout

MOE = ["model.family=qwen3_moe", "model.qk_norm=true", "model.num_experts=4", "model.num_experts_per_tok=2",
       "model.moe_intermediate_size=64", "algorithm.name=grpo", "rollout.max_prompt_length=12",
       "rollout.max_response_length=8", "trainer.prompts_per_step=16", "rollout.samples_per_prompt=2",
       "trainer.actor_lr=1e-3", "logging.progress=false", "task.num_digits=1", "task.eval_size=16",
       "plan.stages.actor-gen.dp=2"]


def _cfg(*extra):
    return load_config(None, MOE + list(extra))


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """2 GRPO steps after a short supervised warm start (a random model earns no reward: nothing would train)."""
    warm = warm_actor(_cfg("trainer.warmup_sft_steps=100"), str(tmp_path_factory.mktemp("moe-warm")))
    j = job_for(_cfg("plan.stages.actor-train.ep=2"), actor=warm)
    before = j.actor_host_params()
    results = [j.step(s) for s in range(2)]
    yield j, before, results
    j.close()


def test_steps_train_every_expert_and_the_router(job):
    j, before, results = job
    assert j.plan[ACTOR_TRAIN].layout == Layout(ep=2)
    assert all(np.isfinite(r.metrics["loss"]) for r in results)
    assert any(r.metrics["reward_mean"] > 0 for r in results)
    after = j.actor_host_params()
    for name in ("router", "w_gate", "w_up", "w_down"):
        moved = np.abs(after["layers"]["moe"][name] - before["layers"]["moe"][name])
        axes = (0, 1) if name == "router" else (0, 2, 3)  # per expert (the router: its expert column)
        assert np.all(moved.max(axis=axes) > 0), f"{name}: an expert got no update"
    for r in results:  # actor-infer's per-expert counts: between balanced (1/4) and every token on one (1/top-2)
        assert 0.25 <= r.metrics["router_busiest_expert_share"] <= 0.5


def test_busiest_expert_share_averages_each_layers_busiest_expert():
    counts_le = np.array([[6, 2, 0, 0], [2, 2, 2, 2], [0, 0, 0, 0]])  # a layer that counted nothing: share 0
    assert busiest_expert_share(counts_le) == pytest.approx((0.75 + 0.25 + 0.0) / 3)


@pytest.mark.long  # ~55 s; the dense and LoRA jobs' random moves run in CI
def test_moves_between_random_plans_keep_every_bit_and_the_job_trains_on(job):
    j, _, _ = job
    move_randomly(j, random.Random(3), 2, layouts=LAYOUTS + [Layout(ep=2), Layout(ep=4), Layout(tp=2, ep=2)])
    assert np.isfinite(j.step(2).metrics["loss"])


def test_a_checkpoint_resumes_into_another_layout_and_exports_a_qwen3_moe_checkpoint(job, tmp_path):
    j, _, _ = job
    ckpt = Checkpointer(str(tmp_path / "ck"))
    ckpt.save(j, 3, wait=True)
    ckpt.close()
    want = host_state(j)
    cfg = _cfg("plan.stages.actor-train.tp=2", "plan.stages.actor-train.dp=4")
    other, _ = restore_for(cfg, str(tmp_path / "ck"), plan=plan_from_config(cfg))
    try:
        assert other.plan[ACTOR_TRAIN].layout == Layout(tp=2)
        assert_same_state(host_state(other), want)
    finally:
        other.close()
    out = export_actor(j, tmp_path / "hf")
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen3MoeForCausalLM"]
    cfg_back, back = load_hf(out, dtype="float32")
    assert cfg_back.num_experts == 4
    params = j.actor_host_params()
    for name, x in params["layers"]["moe"].items():
        np.testing.assert_array_equal(back["layers"]["moe"][name], x)


@pytest.fixture(scope="module")
def bf16_steps():
    """One step of jobs that differ only in routing replay (and, replayed, actor-train's pp: 1 or 2, GPipe):
    bf16 generation, float32 training."""
    out = {}
    for name, extra in (("plain", []), ("replayed", ["algorithm.routing_replay=true"]),
                        ("replayed_pp2", ["algorithm.routing_replay=true", "plan.stages.actor-train.pp=2"])):
        cfg = _cfg("model.compute_dtype=bfloat16", "trainer.pipeline_schedule=gpipe", "algorithm.router_aux_coef=0.001",
                   *extra)
        j = job_for(cfg)
        try:
            out[name] = j.step(0).metrics
        finally:
            j.close()
    return out


@pytest.mark.long  # ~80 s with its fixture (bf16 replay shown in docs/results.md; the mechanics: test_moe_losses)
def test_bf16_generation_mismatches_training_routes_unless_they_are_replayed(bf16_steps):
    plain, replayed = bf16_steps["plain"], bf16_steps["replayed"]
    assert plain["router_compared_tokens"] == replayed["router_compared_tokens"] > 100
    assert plain["router_mismatch_fraction"] > 0
    assert plain["router_own_mismatch_fraction"] == plain["router_mismatch_fraction"]
    assert replayed["router_mismatch_fraction"] == 0
    assert replayed["router_own_mismatch_fraction"] == plain["router_own_mismatch_fraction"]
    # transformers' loss is top_k (2) for a perfectly balanced router and up to num_experts (4); a fresh router's
    # probabilities are nearly uniform (weights of std 0.02), so its loss sits near 2 whatever tokens go where
    for m in (plain, replayed):
        assert abs(m["router_aux_loss"] - 2.0) < 0.05


@pytest.mark.long  # shares the bf16 fixture above; 1F1B replay: test_moe_losses
def test_a_pipelined_actor_train_scores_and_replays_routes_as_one_stage_does(bf16_steps):
    one, two = bf16_steps["replayed"], bf16_steps["replayed_pp2"]
    for key in ("router_mismatch_fraction", "router_own_mismatch_fraction", "router_compared_tokens",
                "router_busiest_expert_share"):
        assert two[key] == one[key], key
    np.testing.assert_allclose(two["router_aux_loss"], one["router_aux_loss"], rtol=1e-5)
    np.testing.assert_allclose(two["loss"], one["loss"], rtol=1e-5, atol=1e-7)
