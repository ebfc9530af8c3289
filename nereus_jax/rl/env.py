"""Environments of multi-turn (agentic) rollouts: what the model talks to between its turns.

The protocol (``task.env=package.module:Class`` names a user class; the class is built as ``Class(task_cfg,
tools, fmt)``):

    env.reset(problem) -> list of chat messages           # the conversation the first turn answers
    env.step(messages, assistant_message) -> EnvStep      # the messages to append, a reward, done

``messages`` is the conversation so far (a list the caller owns; ``step`` must not modify it). ``EnvStep.reward``
is added to the task's reward of the final answer (None: nothing added); ``done`` ends the trajectory.

The built-in :class:`ToolEnv` (``task.env=calculator``, ``python`` or ``tools`` with ``task.tools``) answers every
tool call in the assistant's message with the tool's output, or with the error (a malformed call, an unknown
tool, a tool that raised or ran past ``rollout.tool_timeout``) so the model can go on; a message with no tool
call ends the trajectory, and the task's reward scores it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import importlib
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from nereus_jax.rl.tasks import Problem
from nereus_jax.rl.tokenizer import as_messages
from nereus_jax.rl.tools import BUILTIN_TOOLS, Tool, ToolError, ToolTimeout, parse_tool_calls, result_text

BUILTIN_ENVS = ("calculator", "python", "tools")


@dataclasses.dataclass
class EnvStep:
    messages: list[dict[str, Any]]  # to append after the assistant's message (tool results, a user turn)
    reward: float | None = None
    done: bool = False
    tool_calls: int = 0
    tool_errors: int = 0  # malformed calls, unknown tools and tools that raised
    tool_timeouts: int = 0
    tool_seconds: float = 0.0


class Env(Protocol):
    def reset(self, problem: Problem) -> list[dict[str, Any]]: ...

    def step(self, messages: Sequence[Mapping[str, Any]], assistant: Mapping[str, Any]) -> EnvStep: ...


class EnvError(ValueError):
    """An environment that cannot be built (names the setting and the fix)."""


class ToolEnv:
    """Answers tool calls (see the module docstring). ``fmt`` is the calls' format (``rl.tools.FORMATS``)."""

    def __init__(self, tools: Sequence[Tool], fmt: str, *, system_prompt: str | None = None,
                 timeout: float = 10.0):
        self.tools = {t.name: t for t in tools}
        self.fmt, self.system_prompt, self.timeout = fmt, system_prompt, timeout
        self._pool = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="nereus-tool")

    def reset(self, problem: Problem) -> list[dict[str, Any]]:
        if isinstance(problem.prompt, str) and self.fmt == "plain":
            return [{"role": "user", "content": (self.system_prompt or "") + problem.prompt}]
        return as_messages(problem.prompt, self.system_prompt)

    def step(self, messages: Sequence[Mapping[str, Any]], assistant: Mapping[str, Any]) -> EnvStep:
        calls = parse_tool_calls(str(assistant.get("content", "")), self.fmt, self.tools)
        if not calls:
            return EnvStep([], done=True)
        out = EnvStep([], tool_calls=len(calls))
        start = time.perf_counter()
        for call in calls:
            if call.error is not None:
                text, out.tool_errors = f"error: {call.error}", out.tool_errors + 1
            else:
                text, status = self.call(call.name, call.arguments)
                out.tool_errors += status == "error"
                out.tool_timeouts += status == "timeout"
            out.messages.append({"role": "tool", "name": call.name or "tool", "content": text})
        out.tool_seconds = time.perf_counter() - start
        return out

    def call(self, name: str, arguments: Mapping[str, Any]) -> tuple[str, str]:
        """(text for the model, "ok" / "error" / "timeout"). A tool that does not return within the timeout
        (plus a second's grace) is abandoned in its thread; its answer is a timeout message."""
        future = self._pool.submit(self.tools[name].run, arguments, self.timeout)
        try:
            return future.result(timeout=self.timeout + 1.0), "ok"
        except ToolTimeout as e:
            return f"error: {e}", "timeout"
        except concurrent.futures.TimeoutError:
            return f"error: the tool ran past {self.timeout:g} s and was stopped", "timeout"
        except ToolError as e:
            return f"error: {e}", "error"
        except Exception as e:  # noqa: BLE001 - a tool's bug is the model's error message, never the job's
            return f"error: {type(e).__name__}: {e}", "error"

    def render_result(self, text: str) -> str:
        return result_text(self.fmt, text)


def make_env(task_cfg, fmt: str, timeout: float) -> Env:
    """The environment ``task.env`` names (see the module docstring)."""
    name = task_cfg.env
    if name in BUILTIN_ENVS:
        names = (name,) if name != "tools" else tuple(task_cfg.tools)
        unknown = [n for n in names if n not in BUILTIN_TOOLS]
        if unknown or not names:
            raise EnvError(f"task.tools={list(names)}: the built-in tools are {sorted(BUILTIN_TOOLS)}")
        return ToolEnv([BUILTIN_TOOLS[n] for n in names], fmt, system_prompt=task_cfg.system_prompt,
                       timeout=timeout)
    module, _, attr = str(name).partition(":")
    if not attr:
        raise EnvError(f"task.env={name!r} is neither a built-in ({', '.join(BUILTIN_ENVS)}) nor "
                       "'package.module:Class'")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise EnvError(f"task.env={name!r}: {e}; the module must be importable from the job's Python") from e
    tools = [BUILTIN_TOOLS[n] for n in task_cfg.tools if n in BUILTIN_TOOLS]
    env = cls(task_cfg, tools, fmt)
    for method in ("reset", "step"):
        if not callable(getattr(env, method, None)):
            raise EnvError(f"task.env={name!r} has no {method}() method (see nereus_jax.rl.env)")
    return env


def tool_schemas(env: Env) -> list[dict[str, Any]] | None:
    """The schemas the chat template shows the model (None: the environment offers no tools)."""
    tools = getattr(env, "tools", None)
    if not tools:
        return None
    return [t.schema() for t in (tools.values() if isinstance(tools, Mapping) else tools)]
