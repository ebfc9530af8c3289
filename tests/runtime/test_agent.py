"""Multi-turn rollouts in the job (task.env): every turn is the model's own greedy continuation of the whole
conversation so far (reference: one forward pass of the policy over the trajectory), a trajectory that ends at
once is the single-turn rollout bit for bit, the environment's tokens carry no loss (garbage targets there leave
the gradient bit-identical), and an RL step trains on trajectories and logs turns and tool metrics."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jobs import tiny_job

from nereus_jax.config import load_config
from nereus_jax.model_stage import ACTOR_GEN
from nereus_jax.rl.env import EnvStep
from nereus_jax.rl.tasks import make_task
from nereus_jax.rl.tokenizer import CharTokenizer, as_messages
from nereus_jax.runtime.step.losses import actor_loss, response_logits

AGENT = ["task.env=test_agent:ScriptedEnv", "rollout.max_response_length=32", "rollout.max_turns=3",
         "trainer.actor_lr=1e-3"]
RESULT = "[result: 7]"


class ScriptedEnv:
    """Answers each of the first two turns with the same tool result, then ends (no tool offered)."""

    def __init__(self, task_cfg, tools, fmt):
        self.fmt = fmt

    def reset(self, problem):
        return as_messages(problem.prompt)

    def step(self, messages, assistant):
        turn = sum(m["role"] == "assistant" for m in messages) + 1
        if turn >= 3:
            return EnvStep([], reward=0.5, done=True)
        return EnvStep([{"role": "tool", "content": "7"}], tool_calls=1)


class EndEnv(ScriptedEnv):
    def step(self, messages, assistant):
        return EnvStep([], done=True)


@pytest.fixture(scope="module")
def job(warm):
    job = tiny_job(AGENT, actor=warm)
    yield job
    job.close()


def _problems(job, k=8):
    positions = np.arange(k, dtype=np.int64)
    return [job.rollout.task.problem(int(p)) for p in positions], positions


def test_every_turn_is_the_greedy_continuation_of_the_whole_conversation(job):
    problems, positions = _problems(job)
    batch = job.collect_rollouts(problems, positions, 0.0, n=1)
    tok = CharTokenizer()
    own, ctx = batch.response_mask_br, batch.context_mask_br
    assert np.all(own <= ctx) and np.all(np.diff(ctx, axis=1) <= 0)  # the context is one contiguous run
    env_turns = 0
    for row in range(len(problems)):
        n = int(ctx[row].sum())
        runs = np.split(np.arange(n), np.flatnonzero(np.diff(own[row, :n])) + 1)
        for run in runs:
            if own[row, run[0]] == 0:  # the environment's tokens: exactly the rendered tool result
                assert tok.decode(batch.response_br[row, run]) == RESULT
                env_turns += 1
        assert sum(own[row, r[0]] == 0 for r in runs) <= 2
    assert env_turns >= len(problems)  # every trajectory got at least one tool answer
    _assert_greedy_continuation(job, batch)
    mine = own > 0
    # the log-probs the engine recorded are the policy's at every model token, 0 at the environment's
    assert np.all(batch.behaviour_logp_br[~mine] == 0)
    # the reward reads the last assistant message: after the last tool result
    last_turns = []
    for row in range(len(problems)):
        env = np.flatnonzero((ctx[row] > 0) & (own[row] == 0))
        last_turns.append(tok.decode(batch.response_br[row, env[-1] + 1:]))
    assert job.texts(batch) == last_turns


def _assert_greedy_continuation(job, batch):
    """Every model token is the policy's argmax after everything before it (one forward pass, the reference)."""
    params = job.units[ACTOR_GEN][0].to_host()["params"]
    logits = response_logits(params, job.cfg.model, jnp.asarray(batch.tokens()), jnp.asarray(batch.attention_mask()),
                             job.cfg.rollout.max_prompt_length)
    greedy = np.asarray(jnp.argmax(logits, -1))
    mine = batch.response_mask_br > 0
    np.testing.assert_array_equal(batch.response_br[mine], greedy[mine])


@pytest.mark.long  # ~45 s; the engine-level turns tests compare kept and re-prefilled caches bit for bit in CI
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_kept_cache_across_turns_draws_what_re_prefilling_the_conversation_draws(job, monkeypatch, temperature):
    problems, positions = _problems(job)
    agent = job.rollout.agent
    assert agent.keeps_cache()
    kept = job.collect_rollouts(problems, positions, temperature, n=2)
    kept_prefill = agent.metrics["turn_prefill_tokens"]
    monkeypatch.setattr(agent, "keeps_cache", lambda: False)
    full = job.collect_rollouts(problems, positions, temperature, n=2)
    for name in ("response_br", "response_mask_br", "context_mask_br", "policy_version_b"):
        np.testing.assert_array_equal(getattr(kept, name), getattr(full, name), err_msg=name)
    # the kept keys and values were computed a decode step at a time, the re-prefilled ones in one prefill:
    # float32 rounding of a different order (3e-6 measured over 4 turns), the same tokens
    np.testing.assert_allclose(kept.behaviour_logp_br, full.behaviour_logp_br, atol=1e-5, rtol=0)
    assert kept_prefill < agent.metrics["turn_prefill_tokens"]  # only the new tokens of each later turn


def test_a_trajectory_that_ends_at_once_is_the_single_turn_rollout(job):
    problems, positions = _problems(job)
    agent = job.rollout.agent
    env = agent.env
    try:
        agent.env = EndEnv(None, (), "plain")
        multi = job.collect_rollouts(problems, positions, 1.0, n=2, step=0)
        job.rollout.agent = None
        single = job.collect_rollouts(problems, positions, 1.0, n=2, step=0)
    finally:
        job.rollout.agent, agent.env = agent, env
    assert single.context_mask_br is None and multi.env_reward_b is None
    np.testing.assert_array_equal(multi.context_mask_br, single.response_mask_br)
    for name in ("prompt_bp", "prompt_mask_bp", "response_br", "response_mask_br", "policy_version_b"):
        np.testing.assert_array_equal(getattr(multi, name), getattr(single, name), err_msg=name)
    np.testing.assert_array_equal(multi.behaviour_logp_br.view(np.uint32), single.behaviour_logp_br.view(np.uint32))
    assert job.texts(multi) == job.texts(single)


def test_the_environments_tokens_carry_no_gradient(job):
    problems, positions = _problems(job, 4)
    batch = job.collect_rollouts(problems, positions, 1.0, n=2)
    env_cols = (batch.context_mask_br > 0) & (batch.response_mask_br == 0)
    assert env_cols.any()
    params = job.units[ACTOR_GEN][0].to_host()["params"]
    loss = actor_loss(job.cfg.model, job.cfg.algorithm, job.cfg.rollout.max_prompt_length)
    rng = np.random.default_rng(0)
    base = {"tokens": batch.tokens(), "mask": batch.attention_mask(), "response_mask": batch.response_mask_br,
            "old_logp": batch.behaviour_logp_br, "ref_logp": batch.behaviour_logp_br,
            "advantages": rng.normal(size=batch.response_br.shape).astype(np.float32)}
    garbage = dict(base)  # other log-probs and advantages, of the sizes real ones take, at the environment's tokens
    shape = env_cols.shape
    for key, noise in (("old_logp", rng.uniform(-20, 0, shape)), ("ref_logp", rng.uniform(-20, 0, shape)),
                       ("advantages", rng.normal(size=shape) * 5)):
        garbage[key] = np.where(env_cols, noise, base[key]).astype(np.float32)

    def grads(mb):
        return jax.grad(lambda p: loss(p, {k: jnp.asarray(v) for k, v in mb.items()})[0])(params)

    same = jax.tree.map(lambda a, b: np.array_equal(np.asarray(a), np.asarray(b)), grads(base), grads(garbage))
    assert all(jax.tree.leaves(same))
    # the check can fail: with the environment's tokens in the loss mask the same garbage moves the gradient
    leaky = {**garbage, "response_mask": batch.context_mask_br}
    moved = jax.tree.map(lambda a, b: np.array_equal(np.asarray(a), np.asarray(b)),
                         grads({**base, "response_mask": batch.context_mask_br}), grads(leaky))
    assert not all(jax.tree.leaves(moved))


def test_a_step_trains_on_trajectories_and_logs_turns_and_tool_metrics(job):
    metrics = job.step(0).metrics
    assert 1 < metrics["turns_mean"] <= 3 and metrics["tool_calls_mean"] > 0
    assert metrics["env_tokens_mean"] > 0 and metrics["response_tokens_mean"] > 0
    assert 0 < metrics["env_reward_mean"] <= 0.5  # ScriptedEnv's 0.5 at a third turn, added to the task's
    for key in ("tool_errors", "tool_timeouts", "tool_seconds", "trajectories_truncated"):
        assert key in metrics
    assert np.isfinite(metrics["policy_loss"])



def test_warm_start_demonstrations_show_the_plain_calculator_call_and_mask_its_result():
    from nereus_jax.runtime.durability.warmstart import encode_sft

    tok = CharTokenizer()
    problems = [make_task(load_config(None).task).problem(i) for i in range(4)]
    batch = encode_sft(problems, tok, 12, 40, tool_fraction=0.5)
    plain = encode_sft(problems, tok, 12, 40)
    for j, p in enumerate(problems):
        r, own, ctx = batch["tokens"][j, 12:], batch["response_mask"][j], batch["mask"][j, 12:]
        if j % 2 == 0:  # rows 1 and 3 demonstrate (evenly spread), rows 0 and 2 answer directly
            np.testing.assert_array_equal(batch["tokens"][j], plain["tokens"][j])
            np.testing.assert_array_equal(own, plain["response_mask"][j])
            continue
        call, result = f"[calculator: {p.prompt[:-1]}]", f"[result: {p.answer}]"
        assert tok.decode(r[ctx > 0]) == call + result + p.answer
        assert tok.decode(r[own > 0]) == call + p.answer  # the tool's tokens are context only
    assert batch["denom"] == batch["response_mask"].sum()


@pytest.mark.long  # ~2.5 min: CI time; run with -m long (figures: docs/results.md, Agents)
@pytest.mark.slow  # ~2.5 min: the warm start (about 1,000 supervised steps) and 30 RL steps
def test_agent_tiny_learns_and_calls_the_calculator_more(tmp_path):
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8 "
           + os.environ.get("NEREUS_TEST_XLA_FLAGS", "")}
    out = subprocess.run([sys.executable, "-m", "nereus_jax.train", "agent_tiny", "logging.progress=false",
                          "trainer.sft_control=false", "--run-dir", str(tmp_path / "run")], capture_output=True,
                         text=True, env=env, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "tool_calls_mean" in r]
    assert summary["steps"] == 30 and len(rows) == 30
    assert summary["accuracy_after"] - summary["accuracy_before"] >= 0.10, summary
    first, last = (np.mean([r["tool_calls_mean"] for r in part]) for part in (rows[:5], rows[-5:]))
    assert 0 < first < last, (first, last)
    assert all(r["turns_mean"] <= 3 and r["tool_timeouts"] == 0 for r in rows)


@pytest.mark.long  # ~30 s: CI time; run with -m long
def test_async_one_step_off_runs_trajectories_and_logs_each_steps_own_metrics():
    from nereus_jax.runtime.control.adapt import Adapter
    from nereus_jax.runtime.run import rl_steps

    job = tiny_job(AGENT + ["trainer.mode=async", "trainer.max_staleness=1", "plan.colocate=false",
                            "plan.stages.actor-gen.dp=4"])
    adapter = Adapter(job, log=lambda _: None)
    try:
        got = list(rl_steps(job, adapter, 3))
    finally:
        adapter.close()
        job.close()
    assert [int(r.batch.policy_version_b.max()) for r in got] == [0, 0, 1]
    for r in got:  # each step's turn metrics are its own batch's
        env_tokens = ((r.batch.context_mask_br > 0) & (r.batch.response_mask_br == 0)).sum(1).mean()
        assert r.metrics["env_tokens_mean"] == pytest.approx(env_tokens) and r.metrics["turns_mean"] > 1


@pytest.mark.long  # ~40 s: CI time; run with -m long
@pytest.mark.slow  # ~1 min: a checkpoint's job, a resume
def test_a_chat_checkpoint_runs_trajectories_in_its_template_checkpoints_and_resumes(tmp_path):
    import json

    from hf_checkpoints import write_checkpoint, write_prompts

    from nereus_jax.runtime.run import run_job

    ckpt = write_checkpoint(tmp_path / "ckpt", "qwen3", seed=1)
    prompts = write_prompts(tmp_path / "prompts.jsonl", 40)
    base = ["algorithm.name=grpo", "rollout.samples_per_prompt=2", "rollout.max_prompt_length=24",
            "rollout.max_response_length=48", "rollout.max_turns=3", "trainer.prompts_per_step=4",
            "plan.stages.actor-gen.dp=2", "task.name=file", "task.reward=math", "task.eval_size=4",
            "logging.progress=false", "logging.tensorboard=false", "controller.enabled=false",
            f"model.hf_path={ckpt}", f"task.prompt_file={prompts}", "task.env=test_agent:ScriptedEnv",
            "checkpoint.every_steps=1"]
    run = tmp_path / "run"
    first = run_job(load_config(None, base + ["trainer.steps=2"]), str(run))
    assert first["steps"] == 2
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(r["turns_mean"] > 1 and r["env_tokens_mean"] > 0 for r in rows if "turns_mean" in r)
    resumed = run_job(load_config(None, base + ["trainer.steps=3", f"checkpoint.resume_from={run / 'checkpoints'}"]),
                      str(tmp_path / "resumed"))
    assert resumed["steps"] == 3


def test_after_moves_between_random_plans_turns_go_on_as_before(job):
    import random

    from plans import move_randomly

    move_randomly(job, random.Random(3), 2)
    problems, positions = _problems(job)
    batch = job.collect_rollouts(problems, positions, 0.0, n=1)
    assert ((batch.context_mask_br > 0) & (batch.response_mask_br == 0)).any()
    _assert_greedy_continuation(job, batch)
