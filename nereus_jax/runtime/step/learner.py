"""A job's learner side: from a step's rollouts to updated parameters and the step's metrics.

:class:`Learner` rewards the rollouts (the task's reward, or reward-infer's model), tops a batch up by dynamic
sampling, scores it (actor-infer, ref-infer, critic-infer), estimates the advantages, corrects them for the
rollout/train mismatch and staleness (the order: :mod:`nereus_jax.runtime.step.job`), trains actor-train and
critic-train, stops after ``trainer.max_nonfinite_steps`` non-finite steps in a row (a step whose scores or
an update are not finite changes no weights), and reports the metrics.
It runs the programs of the stage state (:class:`~nereus_jax.runtime.step.stages.StageState`) and generates the
extra rollouts it needs (dynamic sampling, ReMax's greedy baseline) through the rollout side.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from nereus_jax.config import Config
from nereus_jax.elastic.emu import split_replicas
from nereus_jax.elastic.plan import ExecutionPlan
from nereus_jax.model_stage import ACTOR_TRAIN, CRITIC_TRAIN, REWARD_INFER, ModelStage, declared, stage_decl
from nereus_jax.rl import algorithms as alg
from nereus_jax.rl.batch import RolloutBatch
from nereus_jax.rl.registry import AlgorithmSpec
from nereus_jax.rl.tasks import Problem
from nereus_jax.runtime.platform.device_memory import device_bytes_in_use
from nereus_jax.runtime.step.initial_plan import job_topology
from nereus_jax.runtime.step.rollout import Rollout
from nereus_jax.runtime.step.stages import JobError, StageState
from nereus_jax.sharding import to_numpy, tree_to_numpy

# dynamic sampling's extra prompts: a part of the data stream steps never reach, whose sampling keys
# (position mod 2**31) start at 2**30, away from the steps' own
EXTRA_INDEX_OFFSET = (1 << 42) + (1 << 30)


class NonFiniteTraining(JobError):
    """Training stopped: ``trainer.max_nonfinite_steps`` steps in a row were non-finite (see
    :meth:`Learner.check_finite`); no non-finite update was applied. ``first_step``: the streak's first step
    (run_job adds the checkpoint to resume from: the newest written before the update that preceded it)."""

    def __init__(self, message: str, first_step: int):
        super().__init__(message)
        self.first_step = first_step


@dataclasses.dataclass
class StepResult:
    metrics: dict[str, Any]
    batch: RolloutBatch


class Learner:
    """Rewards, scores, advantages, corrections and training of a step (see the module docstring); holds the
    training counts (``updates``, ``nonfinite``, ``nonfinite_since``, ``skipped``) and the last packed stage's
    fill."""

    def __init__(self, cfg: Config, stages: StageState, rollout: Rollout, rewarder, algo: AlgorithmSpec,
                 settings: alg.Settings):
        self.cfg, self.stages, self.rollout, self.rewarder = cfg, stages, rollout, rewarder
        self.algo, self.settings = algo, settings
        self.P, self.R, self.n, self.rows = stages.P, stages.R, rollout.n, stages.rows
        self.updates: dict[ModelStage, int] = {}  # successful training updates per model-stage (this Job)
        self.packing_fill: float | None = None  # with trainer.packing: the last packed stage's real tokens / slots
        self.nonfinite = 0  # consecutive non-finite steps (scores or an update): the current streak
        self.nonfinite_since: int | None = None  # the streak's first step (None: the last step was finite)
        self.skipped: dict[ModelStage, int] = {}  # skipped updates per stage in all
        self._step_skips: dict[ModelStage, str] = {}  # this step's stages with an update skipped: the cause
        self.routing_metrics: dict[str, float] = {}  # the last batch's router_mismatch_fraction (MoE actors)
        self.topology = job_topology(cfg)  # which scoring stages a step runs, and on whose units

    def learn(self, step: int, problems: Sequence[Problem], batch: RolloutBatch, seconds: dict[str, float],
              sync) -> StepResult:
        """Reward, score, train on ``batch`` (the rollouts of step ``step``), then ``sync()`` the weights
        (see :meth:`nereus_jax.runtime.step.job.Job.learn`)."""
        t = time.perf_counter()
        self.stages.peak_bytes = 0  # this step's scoring and training programs' peak (StageState.run)
        scores, reward_metrics = self.rewards(problems, batch)
        seconds["reward-infer" if self.stages.reward_model is not None else "reward"] = time.perf_counter() - t
        sampled = {}
        if self.settings.dynamic_sampling:
            problems, batch, scores, sampled = self.dynamic_sampling(step, problems, batch, scores, seconds)
        staleness = self.stages.version - batch.policy_version_b
        stale = {"rollout_staleness_max": int(staleness.max()), "rollouts_dropped": 0}
        if self.cfg.trainer.stale_rollouts == "drop" and (staleness > self.cfg.trainer.max_staleness).any():
            keep = (staleness <= self.cfg.trainer.max_staleness).astype(batch.response_mask_br.dtype)
            stale["rollouts_dropped"] = int((1 - keep).sum())
            batch = batch._replace(response_mask_br=batch.response_mask_br * keep[:, None])
        if self.settings.overlong_buffer:
            budget = self.rollout.response_budget(step)  # the buffer: overlong_buffer or its fraction of it
            buffer = alg.settings(self.cfg.algorithm, budget).overlong_buffer
            penalty = alg.overlong_penalty(batch.response_mask_br.sum(1), budget, buffer,
                                           self.cfg.algorithm.overlong_penalty)
            scores, sampled["overlong_penalty_mean"] = scores + penalty, float(penalty.mean())
        scored = self.score(batch, seconds)
        self._step_skips = {}
        bad = nonfinite_scores(scored)
        if bad:  # nothing to learn from: no advantages, corrections or updates (the weights stay as they are)
            train_metrics, corrected = self.skip_training(), {}
        else:
            adv = self.advantages(step, batch, scores, scored)
            adv, corrected = self.correct(adv, batch, scored["old_logp"], staleness)
            train_metrics = self.train(batch, scored, adv, seconds, step)
        self.check_finite(step, bad)
        t = time.perf_counter()
        sync()
        seconds["weight-sync"] = time.perf_counter() - t
        metrics = self.metrics(step, batch, scores, scored, train_metrics, seconds) | reward_metrics
        metrics |= self.rollout.step_metrics(step)  # multi-turn: turns, tool calls and errors, environment tokens
        metrics |= self.routing_metrics
        metrics["accuracy"] = reward_metrics.get("answer_correct_fraction", metrics["accuracy"])
        return StepResult(metrics | stale | corrected | sampled, batch)

    def dynamic_sampling(self, step: int, problems: Sequence[Problem], batch: RolloutBatch, scores: np.ndarray,
                         seconds: dict[str, float]):
        """DAPO's dynamic sampling: keep the prompts whose samples' rewards differ; while fewer than
        ``trainer.prompts_per_step`` are kept, generate another round of as many prompts, at most
        ``algorithm.dynamic_sampling_max_rounds`` rounds. Round r of step s reads data positions
        EXTRA_INDEX_OFFSET + (s * rounds + r - 1) * B + i: a function of the step, so a resumed run draws the
        same. The batch keeps its size: the first B kept prompts in round order, then (a batch still short
        after the cap) dropped prompts whose rows are masked out of the loss. The step's reward metrics stay
        those of its own prompts (round 0), comparable with every other algorithm's."""
        b, n, cap = self.cfg.trainer.prompts_per_step, self.n, self.cfg.algorithm.dynamic_sampling_max_rounds
        rounds = [(list(problems), batch, scores)]
        while sum(int(alg.informative_groups(sc, n).sum()) for *_, sc in rounds) < b and len(rounds) <= cap:
            positions = EXTRA_INDEX_OFFSET + (step * cap + len(rounds) - 1) * b + np.arange(b, dtype=np.int64)
            extra = [self.rollout.task_at(step).problem(int(p)) for p in positions]
            t = time.perf_counter()
            rollouts = self.rollout.collect(extra, positions, self.cfg.rollout.temperature, step=step)
            seconds["actor-gen"] = seconds.get("actor-gen", 0.0) + time.perf_counter() - t
            t = time.perf_counter()
            rounds.append((extra, rollouts, self.rewards(extra, rollouts)[0]))
            key = "reward-infer" if self.stages.reward_model is not None else "reward"
            seconds[key] = seconds.get(key, 0.0) + time.perf_counter() - t
        groups = [p for ps, *_ in rounds for p in ps]
        whole = RolloutBatch.concatenate(r[1] for r in rounds)
        informative = np.concatenate([alg.informative_groups(sc, n) for *_, sc in rounds])
        order = np.concatenate([np.flatnonzero(informative), np.flatnonzero(~informative)])[:b]
        rows = (order[:, None] * n + np.arange(n)).reshape(-1)
        out = whole.select(rows)
        filler = np.repeat(~informative[order], n)
        out = out._replace(response_mask_br=out.response_mask_br * (~filler[:, None]).astype(np.int32))
        metrics = {"dynamic_sampling_rounds": len(rounds) - 1, "dynamic_sampling_filled": int(filler.sum()) // n,
                   "dynamic_sampling_kept_fraction": float(informative.mean())}
        return [groups[g] for g in order], out, np.concatenate([r[2] for r in rounds])[rows], metrics

    def rewards(self, problems: Sequence[Problem], batch: RolloutBatch) -> tuple[np.ndarray, dict[str, float]]:
        """[rows] sequence rewards and their metrics: the reward model's scores (reward-infer), else the
        task's reward (exact, math or a user function; ``problems`` has one entry per prompt)."""
        if self.stages.reward_model is not None:
            scores = self._infer(REWARD_INFER, "scores", batch)
            if not np.all(np.isfinite(scores)):
                raise JobError(f"the reward model task.reward_model_path={self.cfg.task.reward_model_path!r} gave "
                               f"{int((~np.isfinite(scores)).sum())} non-finite scores: check that its vocabulary "
                               "covers the tokenizer's and that its weights are finite")
            return scores, {"reward_mean": float(scores.mean())}
        n = len(batch.response_br) // len(problems)
        out = self.rewarder.score([p for p in problems for _ in range(n)], self.rollout.texts(batch))
        if batch.env_reward_b is None:
            return out.rewards, out.metrics()
        return out.rewards + batch.env_reward_b, out.metrics() | {"env_reward_mean": float(batch.env_reward_b.mean())}

    # ------------------------------------------------------------------------- scoring and training
    def score(self, batch: RolloutBatch, seconds: dict[str, float]) -> dict[str, np.ndarray]:
        """actor-infer's and ref-infer's log-probs of the responses (``old_logp``, ``ref_logp``), and with a
        critic its values (``values``), each [rows, R]."""
        out = {}
        for stage in self.topology.phases[1]:  # the scoring phase, in run order (reward-infer: :meth:`rewards`)
            if stage_decl(stage).scores is None:
                continue
            what, key = stage_decl(stage).scores
            t = time.perf_counter()  # a rider runs on its host's units (actor-infer on actor-train's)
            out[key] = self._infer(ModelStage.parse(self.topology.host(stage)), what, batch,
                                   routes=stage == "actor-infer" and batch.routes_btlk is not None)
            seconds[stage] = time.perf_counter() - t
        return out

    def _infer(self, ms: ModelStage, what: str, batch: RolloutBatch, routes: bool = False) -> np.ndarray:
        """A scoring stage's output on ``batch`` ([rows, R], scores [rows]). ``routes``: actor-infer reads the
        batch's recorded routes (replaying them with ``algorithm.routing_replay``) and sets
        ``routing_metrics`` from its routing mismatch."""
        stages, spec = self.stages, self.stages.specs[ms]
        data = {"tokens": batch.tokens(), "mask": batch.attention_mask()}
        if routes:
            data["routes"] = batch.routes_btlk
        leaves, mesh, key, micro, layout = stages.stage_inputs(ms, data, ("infer", ms, what))
        order = self._packed(layout)
        params = spec.unflatten(leaves)["params"]
        out = to_numpy(stages.run(key, lambda: stages.infer_program(ms, what, mesh), params, micro))
        if ms.kind == "infer":
            stages.park(ms)
        out, *mismatch, counts = out if routes else (out, None)
        out = self._rows(out, order)
        if what == "scores":
            return out.reshape(self.rows).astype(np.float32)
        if routes:
            self.routing_metrics = _routing_metrics(*(self._rows(m, order) for m in mismatch), batch)
            self.routing_metrics["router_busiest_expert_share"] = busiest_expert_share(counts.sum(axis=0))
        return out * batch.response_mask_br

    def _rows(self, out: np.ndarray, order: np.ndarray | None) -> np.ndarray:
        """A program's per-sequence output as [rows, ...] in the batch's row order (packed: unsorted)."""
        out = out.reshape(self.rows, -1)
        return out if order is None else out[np.argsort(order)]

    def _packed(self, layout) -> np.ndarray | None:
        """A packed program's row order (None: padded, rows as given); records its fill for the metrics."""
        if layout is None:
            return None
        self.packing_fill = layout.packed_tokens / layout.tokens.size  # real tokens / token slots run
        return layout.order

    def advantages(self, step: int, batch: RolloutBatch, scores: np.ndarray, scored: dict) -> alg.Advantages:
        """The algorithm's advantages (and GAE's returns) of ``batch``; ReMax generates its greedy baseline."""
        a = self.cfg.algorithm
        if self.algo.advantage in ("gae", "grpo", "dr_grpo", "rloo"):  # one jitted program, not a chain of eager ops
            values = scored["values"] if self.algo.advantage == "gae" else np.zeros_like(scored["old_logp"])
            return _advantage_program(scores, batch.response_mask_br, scored["old_logp"], scored["ref_logp"],
                                      values, advantage=self.algo.advantage, estimator=a.kl_estimator,
                                      kl_in_reward=a.kl_in_reward, kl_coef=a.kl_coef, gamma=a.gamma, lam=a.lam,
                                      n=self.n)
        mask = jnp.asarray(batch.response_mask_br)
        problems = [self.rollout.task_at(step).problem(int(p)) for p in batch.prompt_index_b[:: self.n]]
        greedy = self.rollout.collect(problems, batch.prompt_index_b[:: self.n], 0.0, n=1, step=step)
        base = self.rewarder.score(problems, self.rollout.texts(greedy)).rewards
        return alg.remax(jnp.asarray(scores), mask, jnp.asarray(np.repeat(base, self.n)))

    def correct(self, adv: alg.Advantages, batch: RolloutBatch, old_logp: np.ndarray,
                staleness: np.ndarray) -> tuple[alg.Advantages, dict[str, float]]:
        """Steps 2-5 of the off-policy corrections (the job's module docstring): one weight per token from
        r = pi_old / pi_behaviour on the advantages, and the mismatch metrics of every step."""
        s, t = self.settings, self.cfg.trainer
        mask = batch.response_mask_br
        mode = self.cfg.algorithm.rollout_correction
        metrics = alg.mismatch_metrics(old_logp, batch.behaviour_logp_br, mask, s.correction_low, s.correction_clip)
        stale = (staleness > 0) if t.stale_rollouts == "reweight" else np.zeros(len(staleness), bool)
        if mode == "none" and not stale.any():
            return adv, metrics
        ratio = alg.behaviour_ratio(old_logp, batch.behaviour_logp_br, mask)
        w = alg.correction_weights(ratio, mode, s.correction_low, s.correction_clip)
        if stale.any():
            lag = np.minimum(ratio, t.importance_clip)
            w = np.where(stale[:, None], np.where(w > 0, lag, 0.0) if mode == "icepop" else lag, w)
            metrics["importance_weight_mean"] = float((w * mask)[stale].sum() / max(1, mask[stale].sum()))
        w = (w * mask).astype(np.float32)
        if mode != "none":
            metrics["correction_weight_mean"] = float(w.sum() / max(1, mask.sum()))
            metrics["correction_masked_fraction"] = float(((w == 0) & (mask > 0)).sum() / max(1, mask.sum()))
        return alg.Advantages(jnp.asarray(adv.advantages_bt) * w, adv.returns_bt), metrics

    def train(self, batch, scored, adv, seconds, step: int = 0) -> dict[str, float]:
        """actor-train's (then critic-train's) training program on ``batch`` (the rollouts of ``step``: with LoRA
        dropout, the step seeds the masks); their metrics."""
        data = {"tokens": batch.tokens(), "mask": batch.attention_mask(), "response_mask": batch.response_mask_br,
                "old_logp": scored["old_logp"], "ref_logp": scored["ref_logp"],
                "advantages": np.asarray(adv.advantages_bt, np.float32)}
        t = time.perf_counter()
        replay = {"routes": batch.routes_btlk} if self.cfg.algorithm.routing_replay else {}
        metrics = self.train_stage(ACTOR_TRAIN, data | replay | self.dropout_seed(step, ACTOR_TRAIN))
        seconds["actor-train"] = time.perf_counter() - t
        if self.algo.uses_critic:
            data = {**data, "old_values": scored["values"], "returns": np.asarray(adv.returns_bt, np.float32)}
            t = time.perf_counter()
            metrics |= self.train_stage(CRITIC_TRAIN, data | self.dropout_seed(step, CRITIC_TRAIN))
            seconds["critic-train"] = time.perf_counter() - t
        return metrics

    def dropout_seed(self, step: int, ms: ModelStage) -> dict[str, np.uint32]:
        """With ``model.lora_dropout`` > 0: ``{"dropout_seed": ...}``, the training program's LoRA-dropout seed for
        ``ms`` at ``step``, a function of (``trainer.seed``, step, stage), so a run (and a resumed one) draws the
        same masks; else nothing, and the program is the one without dropout."""
        if not self.cfg.model.lora_dropout:
            return {}
        role = 0 if ms == ACTOR_TRAIN else 1
        seed = np.random.SeedSequence([self.cfg.trainer.seed, step, role]).generate_state(1)[0]
        return {"dropout_seed": np.uint32(seed)}

    def train_stage(self, ms: ModelStage, data: dict) -> dict[str, float]:
        """One training program: mini_batches x ppo_epochs updates of the stage on ``data`` ([rows, ...]).
        Logged: each metric's mean over the updates (``*_max`` / ``*_min``: the extreme), and with more than
        one update ``<model>_per_update``, the policy's ratio and clipping statistics update by update."""
        stages, spec = self.stages, self.stages.unit_spec(ms)
        leaves, mesh, key, micro, layout = stages.stage_inputs(ms, data, ("train", ms), self.cfg.trainer.mini_batches)
        self._packed(layout)
        updated, metrics = stages.run(key, lambda: stages.train_program(ms, spec, mesh),
                                      *stages.train_args(spec, leaves), micro)
        new_leaves = stages.train_result(spec, leaves, updated)  # the frozen base: the same buffers, still shared
        stages.replace(ms, split_replicas(new_leaves, mesh, ms, spec), share=False)
        self.updates[ms] = self.updates.get(ms, 0) + 1
        if ms != ACTOR_TRAIN:  # the actor's state is read again by the weight sync
            stages.park(ms)
        per_update = {k: np.asarray(v, np.float64) for k, v in tree_to_numpy(metrics).items()}  # a collective
        flags = per_update.pop("nonfinite")
        skipped = int(flags.sum())
        metrics = {k: float(_REDUCE.get(k.rsplit("_", 1)[-1], np.mean)(v)) for k, v in per_update.items()}
        if skipped:
            self._step_skips[ms] = (f"{ms}'s loss, gradient norm or update ({skipped} of {len(flags)} updates skipped;"
                                    f" loss {metrics.get('loss')}, gradient norm {metrics.get('grad_norm')})")
        self.skipped[ms] = self.skipped.get(ms, 0) + skipped
        metrics[f"{ms.role}_updates_skipped"] = self.skipped[ms]
        if len(next(iter(per_update.values()))) > 1:
            metrics[f"{ms.role}_per_update"] = {k: v.tolist() for k, v in per_update.items() if k in _PER_UPDATE}
        return metrics

    def skip_training(self) -> dict[str, float]:
        """A step whose scores are not finite: no stage trains (every update it would have run is counted as
        skipped); the ``*_updates_skipped`` metrics."""
        updates = self.cfg.trainer.mini_batches * self.cfg.trainer.ppo_epochs
        metrics = {}
        for ms in (ACTOR_TRAIN, CRITIC_TRAIN) if self.algo.uses_critic else (ACTOR_TRAIN,):
            self.skipped[ms] = self.skipped.get(ms, 0) + updates
            metrics[f"{ms.role}_updates_skipped"] = self.skipped[ms]
        return metrics

    def check_finite(self, step: int, bad_scores: dict[str, int]) -> None:
        """Counts step ``step`` into the streak of non-finite steps, or ends the streak. A step is non-finite
        when a score of its rollouts is (``bad_scores``: actor-infer's or ref-infer's log-probs, critic-infer's
        values; the step then trained nothing), or when a stage's loss, gradient norm or update is (the
        training program kept the stage's old state). No non-finite update is applied, but the weights the
        streak started from may be what is wrong: an update to huge but finite weights passes, and the next
        step's forward overflows. After ``trainer.max_nonfinite_steps`` such steps in a row the job stops,
        naming the causes."""
        causes = [f"{_score_source(k)} ({n} non-finite values)" for k, n in bad_scores.items()]
        causes += list(self._step_skips.values())  # none when the scores were: nothing trained
        if not causes:
            self.nonfinite, self.nonfinite_since = 0, None
            return
        if self.nonfinite == 0:
            self.nonfinite_since = step
        self.nonfinite += 1
        limit = self.cfg.trainer.max_nonfinite_steps
        if self.nonfinite < limit:
            return
        t = self.cfg.trainer
        roles = {"actor"} if "old_logp" in bad_scores or ACTOR_TRAIN in self._step_skips else set()
        roles |= {"critic"} if "values" in bad_scores or CRITIC_TRAIN in self._step_skips else set()
        lrs = " or ".join(f"trainer.{r}_lr={t.actor_lr if r == 'actor' else t.critic_lr}" for r in sorted(roles))
        cause = (f"the learning rate ({lrs}) or the loss coefficients: lower it" if roles else
                 "the reference model's weights (ref-infer): check that they are finite")
        first = self.nonfinite_since
        raise NonFiniteTraining(
            f"{limit} consecutive training steps were non-finite (steps {first}..{step}; step {step}: "
            f"{'; '.join(causes)}); no non-finite update was applied. Likely cause: {cause}", first)

    # ------------------------------------------------------------------------------------ metrics
    def metrics(self, step, batch, scores, scored, train_metrics, seconds) -> dict[str, Any]:
        """The step's metrics: rewards, KL, response lengths, timings, memory, training, policy and plan."""
        mask = batch.response_mask_br
        kl = float(_k1_mean(scored["old_logp"], scored["ref_logp"], mask))
        step_s = sum(seconds.values())
        tokens = int(mask.sum())
        # rows masked out of the loss (dynamic sampling's filler, dropped stale rows) are not responses of length 0
        lengths = mask.sum(1)[mask.sum(1) > 0] if mask.any() else np.zeros(1)
        held = max(device_bytes_in_use(self.stages.devices).values(), default=0)
        peak = max(held, self.stages.peak_bytes)
        cap = self.cfg.cluster.device_memory_bytes
        plan = self.stages.plan
        return {"step": step, "device_bytes_max": held, "device_peak_bytes": peak,
                "predicted_peak_bytes": self.stages.predicted_peak_bytes(), "over_memory_cap": bool(cap and peak > cap),
                "reward_mean": float(scores.mean()), "accuracy": float(np.mean(scores >= 1.0)),
                "kl": kl, "response_length_mean": float(lengths.mean()),
                "response_length_p95": float(np.percentile(lengths, 95)), "response_tokens": tokens,
                "step_seconds": step_s, "tokens_per_s": tokens / max(step_s, 1e-9),
                "stage_seconds": {k: round(v, 4) for k, v in seconds.items()}, **train_metrics,
                "policy_version": self.stages.version, "plan": repr(plan), "plan_short": plan_short(plan),
                **({"packing_fill": self.packing_fill} if self.packing_fill is not None else {})}


def plan_short(plan: ExecutionPlan) -> str:
    return " ".join(f"{ms}:{sp.layout}x{sp.dp}" for ms, sp in plan.items())


@functools.partial(jax.jit, static_argnames=("advantage", "estimator", "kl_in_reward", "kl_coef", "gamma", "lam",
                                             "n"))
def _advantage_program(scores, mask, old_logp, ref_logp, values, *, advantage: str, estimator: str,
                       kl_in_reward: bool, kl_coef: float, gamma: float, lam: float, n: int) -> alg.Advantages:
    """PPO's whitened GAE (token rewards: the score on the last token, minus the KL when ``kl_in_reward``), or
    GRPO's / RLOO's grouped advantages; ``values`` is read by GAE only."""
    if advantage != "gae":
        return alg.ADVANTAGES[advantage](scores, mask, n)
    kl = alg.kl_estimate(old_logp, ref_logp, estimator)
    rewards = alg.token_rewards(scores, mask, kl if kl_in_reward else None, kl_coef)
    out = alg.gae(rewards, values, mask, gamma, lam)
    return alg.Advantages(alg.masked_whiten(out.advantages_bt, mask), out.returns_bt)


def busiest_expert_share(counts_le: np.ndarray) -> float:
    """The busiest expert's share of a layer's routed token-expert pairs, averaged over the layers (each layer's
    busiest expert sets that layer's expert time under expert parallelism, and the layers run in turn): what
    ``Workload.expert_load`` and ``Observation.expert_load`` hold. ``counts_le`` [layers, experts]."""
    counts = np.asarray(counts_le, dtype=np.float64)
    totals = counts.sum(axis=-1)
    return float(np.mean(counts.max(axis=-1) / np.maximum(totals, 1.0)))


def _routing_metrics(mismatch_br: np.ndarray, own_br: np.ndarray, batch: RolloutBatch) -> dict[str, float]:
    """Of the response tokens whose routes the engine recorded (``router_compared_tokens``), the fraction
    actor-infer routed to another expert set than the engine in some layer (``router_mismatch_fraction``: 0
    with routing replay), and the fraction whose top-k by actor-infer's own router differs
    (``router_own_mismatch_fraction``: what replay overrides)."""
    recorded = np.all(batch.routes_btlk[:, batch.prompt_len:] >= 0, axis=(-2, -1)) & (batch.response_mask_br > 0)
    compared = max(1, int(recorded.sum()))
    return {"router_mismatch_fraction": float((mismatch_br * recorded).sum() / compared),
            "router_own_mismatch_fraction": float((own_br * recorded).sum() / compared),
            "router_compared_tokens": int(recorded.sum())}


@jax.jit
def _k1_mean(old_logp, ref_logp, mask) -> jax.Array:
    """The logged ``kl``: the k1 estimate's mean over response tokens."""
    return alg.masked_mean(alg.kl_estimate(old_logp, ref_logp, "k1"), mask)


def nonfinite_scores(scored: dict[str, np.ndarray]) -> dict[str, int]:
    """Each score (``old_logp``, ``ref_logp``, ``values``) holding NaN or inf: how many such values."""
    return {k: int(n) for k, v in scored.items() if (n := np.size(v) - np.count_nonzero(np.isfinite(v)))}


_REDUCE = {"max": np.max, "min": np.min}  # a per-update metric named *_max / *_min; the rest: the mean
_PER_UPDATE = ("clip_fraction", "approx_kl", "ratio_mean", "ratio_max", "ratio_min", "grad_norm")


def _score_source(key: str) -> str:
    """What computed the scores under ``key`` (e.g. "ref-infer's log-probs"), for an error message."""
    stage, what = next((d.name, d.scores[0]) for d in declared() if d.scores and d.scores[1] == key)
    return f"{stage}'s {'values' if what == 'values' else 'log-probs'}"
