"""Multi-turn rollouts: the model's turns and an environment's answers (``task.env``), one trajectory per row.

Turn 1 is the single-turn generation of every prompt's ``n`` samples. After each turn the environment reads
the assistant's message (:mod:`nereus_jax.rl.env`); unless it says done, its messages (tool outputs) are
rendered the way the chat template renders them after that assistant message, tokenized and appended, and the
next turn generates from the whole trajectory so far. The model's own tokens are the only ones the loss reads
(``RolloutBatch.response_mask_br``); every real token is context (``context_mask_br``).

Every conversation stays on the replica that started it, and its turns run asynchronously
(:class:`~nereus_jax.engine.conversations.Conversations`): when a turn ends, the environment's step runs in the
tool pool while that engine's other conversations go on decoding (continuous batching); its answer starts the
conversation's next turn. With ``rollout.turn_cache=keep`` (and a contiguous KV cache) the conversation's cache
stays in its decode slot meanwhile and only the new tokens (the turn's last drawn token, then the
environment's) are prefilled onto it, several conversations in one call; a parked conversation whose slot is
needed is evicted and later prefilled whole, as every later turn is with ``reprefill``. Each turn samples with
a seed of the data position, sample and turn, so the schedule, a split over replicas or a resume draw the same.
A trajectory ends when the environment says done, after ``rollout.max_turns`` turns, or when its tokens fill
the response budget (the step's ``rollout.max_response_length``, capped by ``rollout.max_total_length``).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import zlib
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from nereus_jax.config import ConfigError
from nereus_jax.engine.conversations import Conversations, Turn
from nereus_jax.rl.batch import RolloutBatch, left_pad, right_pad
from nereus_jax.rl.env import Env, EnvStep, make_env, tool_schemas
from nereus_jax.rl.errors import TokenizerError
from nereus_jax.rl.tasks import Problem
from nereus_jax.rl.tools import result_text

_SENTINEL = "\u2063NEREUS-ASSISTANT-TURN\u2063"
TOOL_THREADS = 64  # environment steps (tool calls) of one job running at once; more wait for a thread


@dataclasses.dataclass
class Trajectory:
    """One row's conversation: its prompt ids, messages, and the trajectory's tokens so far (own: the model's)."""

    prompt: list[int]
    messages: list[dict[str, Any]]
    tokens: list[int] = dataclasses.field(default_factory=list)
    own: list[int] = dataclasses.field(default_factory=list)
    logp: list[float] = dataclasses.field(default_factory=list)
    version: int = np.iinfo(np.int32).max
    done: bool = False
    turns: int = 0
    env_reward: float = 0.0
    stats: dict[str, float] = dataclasses.field(default_factory=dict)


class AgentRollouts:
    """The multi-turn side of :class:`~nereus_jax.runtime.step.rollout.Rollout` (which owns the engines)."""

    def __init__(self, rollout, env: Env, fmt: str):
        self.rollout, self.env, self.fmt = rollout, env, fmt
        self.tok, self.cfg = rollout.tok, rollout.cfg
        self.schemas = tool_schemas(env)
        self.chat = fmt != "plain"
        # a conversation whose turn ended waits for no thread: tool calls of this many at once
        self._pool = concurrent.futures.ThreadPoolExecutor(TOOL_THREADS, thread_name_prefix="nereus-env")
        self.metrics: dict[str, float] = {}
        self.engine_seconds: dict[str, float] = {}  # the last collect's engines' wall seconds by phase, summed

    def close(self) -> None:
        self._pool.shutdown(wait=False)

    # ------------------------------------------------------------------------------ prompts and messages
    def prompt_ids(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        if self.chat:
            kw = {"tools": self.schemas} if self.schemas else {}
            return self.tok.encode(self.tok.render(list(messages), add_generation_prompt=True, **kw))
        return self.tok.encode_prompt(str(messages[-1]["content"]), chat=False)

    def continuation(self, traj: Trajectory, step: EnvStep, stopped: bool) -> list[int]:
        """Token ids that follow the assistant's last token: the rest of its turn's markup, the environment's
        messages and the next generation prompt, as the chat template renders them."""
        if not self.chat:
            render = getattr(self.env, "render_result", lambda text: result_text(self.fmt, text))
            return self._plain_ids(" ".join(render(str(m["content"])) for m in step.messages))
        kw = {"tools": self.schemas} if self.schemas else {}
        text = self.tok.render(traj.messages + [{"role": "assistant", "content": _SENTINEL}] + step.messages,
                               add_generation_prompt=True, **kw)
        if text.count(_SENTINEL) != 1:
            raise TokenizerError("the chat template does not render an assistant message's content verbatim, "
                                 "so the tokens after a turn cannot be derived; multi-turn rollouts need one that does")
        after = text.split(_SENTINEL, 1)[1]
        end = self.tok.token_text(traj.tokens[-1]) if stopped else ""
        if end and after.startswith(end):
            after = after[len(end):]  # the model wrote its turn's end token itself
        return self.tok.encode(after)

    def _plain_ids(self, text: str) -> list[int]:
        """``text`` in the character tokenizer's alphabet (other characters dropped, letters lowered)."""
        try:
            return self.tok.encode(text)
        except TokenizerError:
            out = []
            for c in text.lower():
                with contextlib.suppress(TokenizerError):
                    out += self.tok.encode(c)
            return out

    def keeps_cache(self) -> bool:
        """Whether conversations keep their KV cache between turns (``rollout.turn_cache``; contiguous caches)."""
        engines = [g for g in self.rollout.engines if g is not None]
        return self.cfg.rollout.turn_cache == "keep" and bool(engines) and not engines[0].engine.paged

    def stop_tokens(self) -> tuple[int, ...]:
        """The engine's stop tokens: the tokenizer's, and in the plain format with tools the ``]`` that closes
        a call."""
        stops = tuple(self.tok.eos_ids)
        return stops + tuple(self._plain_ids("]")) if not self.chat and self.schemas else stops

    # ------------------------------------------------------------------------------ the turns
    def collect(self, problems: Sequence[Problem], positions: np.ndarray, temperature: float, n: int,
                budget: int) -> RolloutBatch:
        """Trajectories of every prompt's ``n`` samples (prompt-major rows), response columns padded to R."""
        r = self.rollout
        P = r.P
        total = self.cfg.rollout.max_total_length
        starts = [self.env.reset(p) for p in problems]
        prompts = [self.prompt_ids(m) for m in starts]
        longest = max(len(p) for p in prompts)
        if longest > P:
            raise ConfigError(f"an environment's first prompt has {longest} tokens but rollout.max_prompt_length={P}: "
                              "raise rollout.max_prompt_length or shorten what task.env's reset() returns")
        trajs = [Trajectory(prompts[i], [dict(m) for m in starts[i]]) for i in range(len(problems)) for _ in range(n)]
        limits = [budget if total is None else min(budget, total - len(t.prompt)) for t in trajs]
        engine_of = r.engine_split(len(prompts))
        sampling = r.sampling(temperature, n, budget, self.stop_tokens())
        turns = _Turns(self, trajs, limits, positions, n)
        for e in range(len(r.engines)):
            idx = np.flatnonzero(engine_of == e)
            if len(idx):  # a conversation stays on its replica, where its cache is
                convs = Conversations(r.engines[e], [prompts[i] for i in idx], sampling,
                                      prompt_ids=positions[idx] % (2**31), park=self.keeps_cache(),
                                      max_new_tokens_per_prompt=[max(1, min(limits[i * n:(i + 1) * n])) for i in idx])
                turns.add(e, convs, [i * n + j for i in idx for j in range(n)])
        stats = turns.run()
        total = lambda key: sum(s.get(key, 0) for s in stats)  # noqa: E731
        self.metrics = _metrics(trajs) | {"turn_prefill_tokens": total("prefill_tokens"),
                                          "turns_evicted": total("evicted"), "turns_restored": total("restored")}
        self.engine_seconds = {k: total(f"{k}_seconds") for k in ("decode", "prefill", "wait")}
        return self._batch(trajs, positions, n, len(problems))

    def _batch(self, trajs: Sequence[Trajectory], positions: np.ndarray, n: int, count: int) -> RolloutBatch:
        P, R = self.rollout.P, self.rollout.R
        response, own = right_pad([t.tokens for t in trajs], R, self.tok.pad_id)
        own[:, :] = 0
        logp = np.zeros((len(trajs), R), np.float32)
        for i, t in enumerate(trajs):
            own[i, :len(t.own)] = t.own
            logp[i, :len(t.logp)] = np.asarray(t.logp, np.float32) * np.asarray(t.own, np.float32)
        context = (np.arange(R)[None, :] < np.asarray([len(t.tokens) for t in trajs])[:, None]).astype(np.int32)
        prompt, prompt_mask = left_pad([t.prompt for t in trajs], P, self.tok.pad_id)
        rewards = np.asarray([t.env_reward for t in trajs], np.float32)
        return RolloutBatch(prompt, prompt_mask, response, own, logp, np.repeat(positions, n),
                            np.tile(np.arange(n), count).astype(np.int32),
                            np.asarray([t.version for t in trajs], np.int32), context,
                            rewards if np.any(rewards) else None)

    def record(self, t: Trajectory, turn: Turn) -> tuple[str, bool]:
        """A finished turn joins its trajectory; returns its text and whether a stop token ended it."""
        new = turn.tokens.tolist()
        t.tokens += new
        t.own += [1] * len(new)
        t.logp += turn.logprobs.tolist()
        v = turn.versions
        t.version = min(t.version, int(v[v >= 0].min(initial=t.version)))
        t.turns += 1
        return self.tok.decode(new), turn.finish == "stop"

    def advance(self, t: Trajectory, text: str, step: EnvStep, stopped: bool, limit: int, last: bool) -> list[int]:
        """After a turn: the environment's verdict, and the tokens the next turn starts from (appended to the
        trajectory and returned; none when it is done)."""
        for key in ("tool_calls", "tool_errors", "tool_timeouts", "tool_seconds"):
            t.stats[key] = t.stats.get(key, 0) + getattr(step, key)
        t.env_reward += float(step.reward or 0.0)
        t.messages.append({"role": "assistant", "content": text})
        if step.done or last or len(t.tokens) >= limit:
            t.done = True
            return []
        extra = self.continuation(t, step, stopped)
        t.messages += [dict(m) for m in step.messages]
        room = limit - len(t.tokens)
        if len(extra) >= room:  # no room left for the model to answer: the environment's tokens end it
            t.stats["truncated"] = 1
            extra = extra[:room]
            t.done = True
        t.tokens += extra
        t.own += [0] * len(extra)
        t.logp += [0.0] * len(extra)
        return extra


class _Turns:
    """One collect's conversations on the replicas' engines: each finished turn joins its trajectory (in the
    engine's thread) and goes to the environment in the tool pool, whose verdict answers the conversation (its
    next turn) or closes it; meanwhile the engine decodes the others. An error anywhere stops every engine's
    conversations and is raised by :meth:`run`."""

    def __init__(self, agent: AgentRollouts, trajs: list[Trajectory], limits: list[int], positions: np.ndarray,
                 n: int):
        self.agent, self.trajs, self.limits, self.positions, self.n = agent, trajs, limits, positions, n
        self.sessions: list[tuple[int, Conversations, list[int]]] = []  # (engine, conversations, their rows)

    def add(self, engine: int, convs: Conversations, rows: list[int]) -> None:
        self.sessions.append((engine, convs, rows))

    def run(self) -> list[dict]:
        """Runs every engine's conversations to their end, each engine in its thread; their statistics."""
        outs = self.agent.rollout.run_engines([(e, self._runner(c, rows)) for e, c, rows in self.sessions])
        return [outs[e] for e, _, _ in self.sessions]

    def _runner(self, convs: Conversations, rows: list[int]):
        def on_turn(turn: Turn) -> None:
            try:
                row = rows[turn.conversation]
                text, stopped = self.agent.record(self.trajs[row], turn)
                self.agent._pool.submit(self._env_step, convs, turn.conversation, row, text, stopped)
            except BaseException as e:
                self.abort(e)
                raise

        keep = self.agent.keeps_cache()

        def run(gen):
            if keep:  # every later turn's prefill program compiled now, not when a turn first meets its shape
                gen.warm_turns(max_rows=convs.count, max_tokens=max(self.limits[r] for r in rows))
            return convs.run(on_turn)

        return run

    def _env_step(self, convs: Conversations, conversation: int, row: int, text: str, stopped: bool) -> None:
        try:
            agent, t = self.agent, self.trajs[row]
            step = agent.env.step(t.messages, {"role": "assistant", "content": text})
            extra = agent.advance(t, text, step, stopped, self.limits[row], last=t.turns == agent.cfg.rollout.max_turns)
            if t.done:
                convs.close(conversation)
                return
            seed = _turn_seed(int(self.positions[row // self.n]), row % self.n, t.turns)
            convs.answer(conversation, extra, limit=self.limits[row] - len(t.tokens), prompt_id=seed)
        except BaseException as e:  # noqa: BLE001 - raised by run(), in the caller's thread
            self.abort(e)

    def abort(self, error: BaseException) -> None:
        for _, convs, _ in self.sessions:
            convs.fail(error)


def make_agent_env(cfg, tok) -> tuple[Env, str]:
    """``task.env``'s environment and the tool-call format (``task.tool_format``, else hermes with a chat
    template and plain without); a ConfigError / EnvError names a setting that cannot work and its fix."""
    if jax.process_count() > 1:
        raise ConfigError(f"task.env runs its environment in one process; this launch has {jax.process_count()}: "
                          "multi-turn rollouts across processes are not supported yet (use one process)")
    has_template = getattr(tok, "chat_template", None) is not None
    fmt = cfg.task.tool_format or ("hermes" if has_template else "plain")
    if fmt != "plain" and not has_template:
        raise ConfigError(f"task.tool_format={fmt} renders tool messages with the chat template, but the tokenizer "
                          "has none: use task.tool_format=plain, or a checkpoint whose tokenizer has a template")
    return make_env(cfg.task, fmt, cfg.rollout.tool_timeout), fmt


def final_texts(tok, batch: RolloutBatch) -> list[str]:
    """Each row's last assistant message: its model tokens after the last environment token (the answer the
    task's reward scores)."""
    out = []
    for tokens, own, ctx in zip(batch.response_br, batch.response_mask_br, batch.context_mask, strict=True):
        env = np.flatnonzero((ctx > 0) & (own == 0))
        mine = np.flatnonzero(own > 0)
        start = int(env[-1]) + 1 if env.size else 0
        end = int(mine[-1]) + 1 if mine.size and mine[-1] >= start else start
        out.append(tok.decode(tokens[start:end].tolist()))
    return out


def _turn_seed(position: int, sample: int, turn: int) -> int:
    return zlib.crc32(np.asarray([position, sample, turn], np.int64).tobytes()) % (2**31)


def _metrics(trajs: Sequence[Trajectory]) -> dict[str, float]:
    own = np.asarray([sum(t.own) for t in trajs], np.float64)
    env = np.asarray([len(t.own) - sum(t.own) for t in trajs], np.float64)
    get = lambda k: np.asarray([t.stats.get(k, 0) for t in trajs], np.float64)  # noqa: E731
    return {"turns_mean": float(np.mean([t.turns for t in trajs])), "tool_calls_mean": float(get("tool_calls").mean()),
            "tool_errors": int(get("tool_errors").sum()), "tool_timeouts": int(get("tool_timeouts").sum()),
            "tool_seconds": float(get("tool_seconds").sum()), "response_tokens_mean": float(own.mean()),
            "env_tokens_mean": float(env.mean()), "trajectories_truncated": int(get("truncated").sum())}
