"""A job's rollout side: the data stream's prompts, the actor-gen engines, generation across their replicas.

:class:`Rollout` holds one inference engine per actor-gen replica (None for a replica on another process's
devices: its process runs it), generates a step's prompts split over them in order (each engine in a thread of
its own; with several processes every result is shared from its owner), loads the policy's parameters into
them (:meth:`~Rollout.set_params`), builds engines for a target plan ahead (:meth:`~Rollout.prepare_engines`)
and scores held-out prompts (:meth:`~Rollout.evaluate`). The units and the policy version it reads are the
stage state's (:class:`~nereus_jax.runtime.step.stages.StageState`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from nereus_jax.config import Config, ConfigError, stage_at
from nereus_jax.elastic.emu import EMU
from nereus_jax.elastic.plan import ExecutionPlan
from nereus_jax.engine import Generator, JaxEngine, Rollouts, SamplingParams
from nereus_jax.model_stage import ACTOR_GEN
from nereus_jax.models import abstract_params
from nereus_jax.rl.batch import RolloutBatch, left_pad, right_pad
from nereus_jax.rl.tasks import Problem, make_task
from nereus_jax.runtime.platform.distributed import share_from
from nereus_jax.runtime.step.agent import AgentRollouts, final_texts, make_agent_env
from nereus_jax.runtime.step.stages import StageState
from nereus_jax.sharding import is_local, make_mesh


class Rollout:
    """The prompts of every step and the engines that answer them (see the module docstring)."""

    def __init__(self, cfg: Config, task, tokenizer, stages: StageState, rewarder):
        """Builds an engine on every local actor-gen replica of ``stages`` (placed), loaded with its parameters."""
        self.cfg, self.task, self.tok, self.stages, self.rewarder = cfg, task, tokenizer, stages, rewarder
        self.P, self.R = cfg.rollout.max_prompt_length, cfg.rollout.max_response_length
        self.n = cfg.rollout.samples_per_prompt
        self._staged_tasks: dict[int, Any] = {}  # task.schedule: the task of each num_digits, made on first use
        self.agent = _agent(cfg, tokenizer, self)  # task.env: multi-turn rollouts (None: one response a prompt)
        self._step_metrics: dict[int, dict[str, float]] = {}  # rollout metrics (turns, tools) by training step
        # one per actor-gen replica; None for a replica on another process's devices (its process runs it)
        self._engines: list[Generator | None] = [self._engine(u) for u in stages.units[ACTOR_GEN]]
        self._engine_pool: concurrent.futures.ThreadPoolExecutor | None = None  # see _run_local
        self._engine_pool_size = 0
        self.engine_thread_cpu_s = 0.0  # CPU seconds of the engine threads so far (Python and dispatch)

    @property
    def engines(self) -> tuple[Generator | None, ...]:
        """The engine of each actor-gen replica, in the plan's order (None: another process's replica)."""
        return tuple(self._engines)

    def close(self) -> None:
        """Releases the engines' threads."""
        if self._engine_pool is not None:
            self._engine_pool.shutdown(wait=False)
            self._engine_pool = None
        if self.agent is not None:
            self.agent.close()

    def _engine(self, unit: EMU) -> Generator | None:
        if not is_local(unit.devices[0]):
            return None
        engine = self._new_engine(unit.mesh)
        return Generator(engine, engine.adopt_params(unit.params), version=self.stages.version,
                         pad_id=self.tok.pad_id)

    def _new_engine(self, mesh) -> JaxEngine:
        cfg = self.cfg
        return JaxEngine(cfg.model, mesh, max_concurrent_decodes=max(1, cfg.rollout.max_concurrent_decodes),
                         # multi-turn: a later turn's prompt is the trajectory so far, prefilled in one
                         # bucketed batch (chunks onto a growing prefix would compile a program per chunk)
                         max_prefill_length=self.P if self.agent is None else self.P + self.R - 1,
                         max_target_length=self.P + self.R,
                         page_size=cfg.rollout.page_size, kv_bytes=cfg.rollout.kv_cache_bytes,
                         decode_steps_per_call=cfg.rollout.decode_steps_per_call,
                         max_prefill_batch=min(16, max(1, cfg.trainer.prompts_per_step)),
                         max_stop_tokens=max(4, len(self.tok.eos_ids) + (self.agent is not None)),
                         record_routes=cfg.records_routes())

    # ------------------------------------------------------------------------------ the data stream
    def prompt_ids(self, problem: Problem) -> list[int]:
        """A problem's prompt as the model sees it (see :func:`prompt_ids`)."""
        return prompt_ids(self.tok, self.cfg.task, problem)

    def problems(self, step: int) -> tuple[list[Problem], np.ndarray]:
        """Step ``step``'s prompts and their data positions (step*B .. step*B+B-1)."""
        b = self.cfg.trainer.prompts_per_step
        positions = np.arange(step * b, (step + 1) * b, dtype=np.int64)
        task = self.task_at(step)
        return [task.problem(int(p)) for p in positions], positions

    def task_at(self, step: int):
        """The task step ``step`` draws from: ``task.schedule``'s stage then (its num_digits), else the job's."""
        stage = stage_at(self.cfg.task.schedule, step)
        if stage is None or stage.num_digits == getattr(self.task, "num_digits", None):
            return self.task
        if stage.num_digits not in self._staged_tasks:
            cfg = dataclasses.replace(self.cfg.task, num_digits=stage.num_digits, eval_size=0)
            self._staged_tasks[stage.num_digits] = make_task(cfg, seed=self.cfg.trainer.seed)
        return self._staged_tasks[stage.num_digits]

    def response_budget(self, step: int | None) -> int:
        """Step ``step``'s response budget: ``rollout.length_schedule``'s stage then, else (and for None)
        ``rollout.max_response_length``."""
        stage = None if step is None else stage_at(self.cfg.rollout.length_schedule, step)
        return self.R if stage is None else stage.max_response_length

    # ------------------------------------------------------------------------------ engines and plan changes
    def prepare_engines(self, plan: ExecutionPlan) -> list[Generator | None]:
        """Engines on ``plan``'s actor-gen meshes, warmed by a generation from zero weights (None: another
        process's replica, which that process prepares). Touches nothing the current engines use."""
        engines = []
        for replica in plan[ACTOR_GEN].replicas:
            if not is_local(self.stages.devices[replica[0]]):
                engines.append(None)  # another process's replica: that process prepares it
                continue
            mesh = make_mesh([self.stages.devices[i] for i in replica], plan[ACTOR_GEN].layout)
            engine = self._new_engine(mesh)
            gen = Generator(engine, engine.load_params(_zeros(self.cfg.model)), pad_id=self.tok.pad_id)
            problems, positions = self.problems(0)
            share = -(-len(problems) // len(plan[ACTOR_GEN].replicas))
            prompts = [self.prompt_ids(p) for p in problems[:share]]
            gen.rollouts(prompts, self.sampling(self.cfg.rollout.temperature, self.n),
                         prompt_ids=positions[:share] % (2**31))
            engines.append(gen)
        return engines

    def adopt(self, engines: Sequence[Generator | None] | None, same_layout: bool) -> None:
        """After the stage state adopted a plan: ``engines`` (prepared for it) take the moved parameters; else
        the current engines do when actor-gen kept its devices and layout (``same_layout``), and new engines
        are built on the new actor-gen units when it did not."""
        if engines is not None:
            self._engines = list(engines)
        elif not same_layout:
            self._engines = [self._engine(u) for u in self.stages.units[ACTOR_GEN]]
            return
        self.set_params()

    def load_units(self, units, version: int | None = None) -> None:
        """A weight sync's result: actor-gen's new units (``StageState.replace``), and every local engine loads
        them (:meth:`set_params`, tagged with ``version``). Sync mode's sync and async mode's double-buffer
        adopt both go through here, so the generation units and the engines' parameters never differ."""
        self.stages.replace(ACTOR_GEN, units)
        self.set_params(version)

    def set_params(self, version: int | None = None) -> None:
        """Every local engine loads its actor-gen unit's parameters, tagged with the policy ``version`` (default
        the stages' current one; async mode's double buffer adopts an older sync's). The one place the runtime
        gives engines parameters after building them."""
        version = self.stages.version if version is None else version
        for gen, unit in zip(self._engines, self.stages.units[ACTOR_GEN], strict=True):
            if gen is not None:
                gen.set_params(gen.engine.adopt_params(unit.params), version=version)

    # ------------------------------------------------------------------------------ generation
    def collect(self, problems: Sequence[Problem], positions: np.ndarray, temperature: float,
                 n: int | None = None, step: int | None = None) -> RolloutBatch:
        """Rollouts of every prompt, the prompts split over the actor-gen replicas in order; responses are cut
        at step ``step``'s budget (:meth:`response_budget`) and right-padded to the programs' R."""
        n = self.n if n is None else n
        if self.agent is not None:
            batch = self.agent.collect(problems, positions, temperature, n, self.response_budget(step))
            if step is not None:
                self._step_metrics[step] = dict(self.agent.metrics)
            return batch
        prompts = [self.prompt_ids(p) for p in problems]
        _check_prompt_lengths(prompts, self.P)
        out = self.generate(prompts, self.sampling(temperature, n, self.response_budget(step)), positions % (2**31))
        lengths = out.lengths
        response, response_mask = right_pad([list(t[:n_]) for t, n_ in zip(out.tokens, lengths, strict=True)],
                                            self.R, self.tok.pad_id)
        prompt, prompt_mask = left_pad([p for p in prompts for _ in range(n)], self.P, self.tok.pad_id)
        logp = out.logprobs
        logp = np.pad(logp, ((0, 0), (0, self.R - logp.shape[1]))) * response_mask  # a budget under R: pad
        # the oldest policy version behind any of a row's tokens (a resumed partial rollout has several)
        versions = np.where(out.param_versions < 0, np.iinfo(np.int32).max, out.param_versions).min(1)
        return RolloutBatch(prompt, prompt_mask, response, response_mask, logp.astype(np.float32),
                            np.repeat(positions, n), np.tile(np.arange(n), len(prompts)).astype(np.int32),
                            versions.astype(np.int32), routes_btlk=self._routes(out))

    def _routes(self, out: Rollouts) -> np.ndarray | None:
        """The rollouts' recorded routes in the batch's layout, [rows, P + R, layers, k] (-1 where none): the
        prompts' (already left-padded to P) then the responses' (right-padded to R)."""
        if out.routes is None:
            return None
        assert out.prompt_routes.shape[1] == self.P, (out.prompt_routes.shape, self.P)
        width = min(self.R, out.routes.shape[1])
        response = np.full((out.routes.shape[0], self.R, *out.routes.shape[2:]), -1, out.routes.dtype)
        response[:, :width] = out.routes[:, :width]
        return np.concatenate([out.prompt_routes, response], axis=1)

    def step_metrics(self, step: int) -> dict[str, float]:
        """The rollout metrics of step ``step``'s batch (multi-turn: turns, tool calls, environment tokens),
        once: async mode generates step g + 1 while step g learns, so they are kept by step."""
        return self._step_metrics.pop(step, {})

    def engine_split(self, count: int) -> np.ndarray:
        """[count] the actor-gen replica each of ``count`` prompts goes to: contiguous runs, in order."""
        out = np.zeros(count, np.int64)
        for i, idx in enumerate(np.array_split(np.arange(count), len(self._engines))):
            out[idx] = i
        return out

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, ids: np.ndarray,
                 per_prompt: Sequence[int] | None = None) -> Rollouts:
        """Rollouts of ``prompts`` (ids: their identities in the random stream) split over the actor-gen
        replicas (:meth:`engine_split`), as one: rows prompt-major in the given order, every array
        concatenated. ``per_prompt``: each prompt's own token limit."""
        engine_of = self.engine_split(len(prompts))
        limits = None if per_prompt is None else np.asarray(per_prompt, np.int32)
        groups = [(e, np.flatnonzero(engine_of == e)) for e in range(len(self._engines))]

        def work(idx):
            return lambda g: g.rollouts([prompts[j] for j in idx], sampling, prompt_ids=ids[idx],
                                        max_new_tokens_per_prompt=None if limits is None else limits[idx])

        outs = self.on_engines([(e, work(idx)) for e, idx in groups if len(idx)])
        n = sampling.n
        order = np.argsort(np.concatenate([(idx[:, None] * n + np.arange(n)).reshape(-1) for _, idx in groups
                                           if len(idx)]), kind="stable")  # rows back in the prompts' order
        cat = lambda name: np.concatenate([getattr(o, name) for o in outs])[order]  # noqa: E731
        finish = [f for o in outs for f in (o.finish_reasons or ("",) * o.num_rows)]  # another process's: none
        routes = (cat("routes"), cat("prompt_routes")) if outs[0].routes is not None else (None, None)
        return Rollouts(cat("tokens"), cat("logprobs"), cat("lengths"), tuple(finish[i] for i in order),
                        cat("param_versions"), cat("prompt_index"), cat("sample_index"), {}, *routes)

    def on_engines(self, work: Sequence[tuple[int, Any]]) -> list[Rollouts]:
        """``fn(engine)`` for each (engine index, fn), in order. With several processes each process runs
        its own replicas' engines, then every result is shared from its owner, so every process holds
        all rollouts (the same on each)."""
        local = self._run_local([(i, fn) for i, fn in work if self._engines[i] is not None])
        if jax.process_count() == 1:
            return [local[i] for i, _ in work]
        outs = []
        for i, _ in work:
            owner = self.stages.units[ACTOR_GEN][i].devices[0].process_index
            mine = local.get(i)
            routes = self.cfg.records_routes()
            arrays = share_from(owner, None if mine is None else [mine.tokens, mine.logprobs, mine.lengths,
                                                                  mine.param_versions, mine.prompt_index,
                                                                  mine.sample_index]
                                + ([mine.routes, mine.prompt_routes] if routes else []))
            outs.append(mine or Rollouts(*arrays[:3], (), *arrays[3:6], {}, *arrays[6:]))
        return outs

    def run_engines(self, work: Sequence[tuple[int, Any]]) -> dict[int, Any]:
        """``fn(generator)`` for each (engine index, fn) of this process's engines, each engine in a thread of
        its own; the results by engine index. (A result with ``stats`` or a dict of them counts its
        ``thread_cpu_s``.)"""
        return self._run_local(work)

    def _run_local(self, work: Sequence[tuple[int, Any]]) -> dict[int, Any]:
        """This process's engines, each in a thread of its own: every engine's decode loop waits on its own
        devices, so one after another would keep only one replica busy at a time (results do not depend
        on the order: sampling is keyed per request)."""
        if len(work) <= 1:
            return {i: fn(self._engines[i]) for i, fn in work}
        if self._engine_pool is None or self._engine_pool_size < len(work):
            if self._engine_pool is not None:
                self._engine_pool.shutdown(wait=False)
            self._engine_pool = concurrent.futures.ThreadPoolExecutor(len(work), thread_name_prefix="nereus-engine")
            self._engine_pool_size = len(work)
        futures = {i: self._engine_pool.submit(fn, self._engines[i]) for i, fn in work}
        outs = {i: f.result() for i, f in futures.items()}
        self.engine_thread_cpu_s += sum(getattr(o, "stats", o).get("thread_cpu_s", 0.0) for o in outs.values())
        return outs

    def sampling(self, temperature: float, n: int, max_new_tokens: int | None = None,
                 stop_tokens: Sequence[int] | None = None) -> SamplingParams:
        """The rollout config's sampling at ``temperature`` (0: greedy), ``n`` samples a prompt (stop tokens:
        the tokenizer's eos ids unless given)."""
        c = self.cfg.rollout
        return SamplingParams(temperature=temperature, top_k=c.top_k if temperature else 0,
                              top_p=c.top_p if temperature else 1.0, max_new_tokens=max_new_tokens or self.R,
                              stop_tokens=tuple(self.tok.eos_ids if stop_tokens is None else stop_tokens), n=n,
                              seed=c.seed)

    def texts(self, batch: RolloutBatch) -> list[str]:
        """Each row's response, decoded up to its length (a multi-turn row: its last assistant message)."""
        if batch.context_mask_br is not None:
            return final_texts(self.tok, batch)
        lengths = batch.response_mask_br.sum(1)
        return [self.tok.decode(r[:n].tolist()) for r, n in zip(batch.response_br, lengths, strict=True)]

    # ------------------------------------------------------------------------------ evaluation
    def evaluate(self, problems: Sequence[Problem], samples: int = 1) -> dict[str, float]:
        """Held-out scores of the current actor-gen parameters: ``pass_at_1``, greedy (the fraction of
        prompts answered correctly), and with ``samples`` = k > 1 ``pass_at_k``, the fraction of prompts
        with at least one correct answer among k samples at the rollout temperature."""
        positions = np.arange(len(problems), dtype=np.int64)
        greedy = self.collect(problems, positions, 0.0, n=1)
        out = {"pass_at_1": float(self.rewarder.score(problems, self.texts(greedy)).correct.mean())}
        if samples > 1:
            sampled = self.collect(problems, positions, self.cfg.rollout.temperature, n=samples)
            rows = [p for p in problems for _ in range(samples)]
            correct = self.rewarder.score(rows, self.texts(sampled)).correct.reshape(len(problems), samples)
            out["pass_at_k"] = float(correct.any(axis=1).mean())
        return out


def prompt_ids(tokenizer, task_cfg, problem: Problem) -> list[int]:
    """A problem's prompt as the model sees it: rendered with the tokenizer's chat template where
    ``task.chat_template`` says so (with ``task.system_prompt``), then tokenized; prompt lengths are counted
    in these tokens."""
    return tokenizer.encode_prompt(problem.prompt, system_prompt=task_cfg.system_prompt, chat=task_cfg.chat_template)


def _agent(cfg: Config, tokenizer, rollout: Rollout) -> AgentRollouts | None:
    if cfg.task.env is None:
        return None
    return AgentRollouts(rollout, *make_agent_env(cfg, tokenizer))


def _zeros(model) -> dict:
    """Canonical parameters of ``model``, all zeros (engine warm-up: shapes matter, values do not)."""
    return jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), abstract_params(model))


def _check_prompt_lengths(prompts: list[list[int]], limit: int) -> None:
    longest = max(len(p) for p in prompts)
    if longest > limit:
        raise ConfigError(f"a prompt has {longest} tokens (with bos) but rollout.max_prompt_length={limit}: "
                          "raise rollout.max_prompt_length or shorten the prompts")
