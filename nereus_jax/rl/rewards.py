"""Rewards for a batch of responses (``task.reward``): exact match, math answers checked by math-verify, or a
user's Python function; nothing a reward does can hang or kill the job.

    with make_rewarder(cfg.task, task, log=print) as rewarder:
        out = rewarder.score(problems, responses)      # one problem per response
        out.rewards, out.correct                       # float32 [n], bool [n]
        out.metrics()                                  # reward_mean, format_ok_fraction, ... for the logs

Kinds:

- ``exact``: the task's own rule (a built-in task's ``reward``, e.g. countdown's; a prompt file: the stripped
  response equals the stripped answer). Runs inline: it cannot hang.
- ``math``: the final answer is extracted from free-text reasoning (the last ``\\boxed{...}``, else GSM8K's
  ``#### 42``, else the last number; ``format_ok`` says one was found) and is correct when math-verify finds
  it equivalent to the reference answer (LaTeX, fractions, equivalent forms); reward 1.0 if correct, else 0.
- ``python``: ``task.reward_fn = "package.module:function"``, a user's function with this contract::

      def function(prompt: str | list[dict[str, str]], response: str, answer: str) -> float

  ``prompt`` as the row gave it (a string, or the chat messages), ``answer`` the row's reference answer.
  The function is imported and checked when the rewarder is built (RewardFunctionError if its module does
  not import or it is not a callable taking three arguments). ``format_ok`` is True where it returned a
  number, ``correct`` where that number is >= 1.

Math and python rewards run in a small pool of worker processes started fresh (not forked: the job's
process runs JAX, which forking breaks; the workers import neither JAX nor the job's main module), each
call limited to ``task.reward_timeout`` seconds. A call that raises, returns something that is not a finite
number, runs past the timeout (its worker is stopped and replaced if it does not return) or kills its worker
process scores 0.0 and counts in ``reward_errors`` or ``reward_timeouts``; the first few are reported through
the ``log`` callback with the reward's name, the row's source (``data.jsonl:17``) and the exception.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import inspect
import json
import logging
import math
import numbers
import os
import re
import reprlib
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from multiprocessing.connection import Connection, Pipe, wait
from typing import Any, NamedTuple

import numpy as np

from nereus_jax.rl.tasks import Problem

_MAX_LOGGED = 5  # failed calls reported through ``log``; later ones are only counted
_GRACE_S = 1.0  # past the timeout, a worker that has not returned is stopped
_STARTUP_S = 120.0  # a worker that does not start within this is an error, not a hang


class RewardFunctionError(ValueError):
    """A reward that cannot be used (a task.reward_fn that does not import or cannot be called, math-verify
    missing); the message names the setting and the fix."""


@dataclass(frozen=True)
class RewardBatch:
    """Rewards of a batch of responses, with what went wrong while computing them."""

    rewards: np.ndarray  # float32 [n]
    format_ok: np.ndarray  # bool [n]: an answer could be extracted / the function returned a number
    correct: np.ndarray  # bool [n]: the answer is right (reward >= 1 for exact and python)
    errors: int = 0  # calls that raised, returned a non-number or killed their worker (scored 0)
    timeouts: int = 0  # calls that ran past task.reward_timeout (scored 0)

    def metrics(self) -> dict[str, float]:
        def mean(a: np.ndarray) -> float:
            return float(a.mean()) if a.size else 0.0

        return {"reward_mean": mean(self.rewards), "format_ok_fraction": mean(self.format_ok),
                "answer_correct_fraction": mean(self.correct), "reward_errors": float(self.errors),
                "reward_timeouts": float(self.timeouts)}


class Rewarder:
    """Scores responses; ``close`` (or leaving a ``with`` block) stops its worker processes."""

    name = "reward"

    def score(self, problems: Sequence[Problem], responses: Sequence[str]) -> RewardBatch:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def __enter__(self) -> Rewarder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ExactRewarder(Rewarder):
    """The task's own reward rule, inline."""

    name = "exact"

    def __init__(self, task):
        self.task = task

    def score(self, problems: Sequence[Problem], responses: Sequence[str]) -> RewardBatch:
        rewards = np.asarray([self.task.reward(p, r) for p, r in zip(problems, responses, strict=True)], np.float32)
        return RewardBatch(rewards, np.ones(len(rewards), bool), rewards >= 1.0)


class _Outcome(NamedTuple):
    status: str  # "ok", "error" or "timeout"
    value: float = 0.0
    detail: str = ""


class _PooledRewarder(Rewarder):
    """A reward whose calls run in a worker pool; failed calls are counted and the first few logged."""

    def __init__(self, pool: _WorkerPool, log: Callable[[str], None] | None):
        self._pool = pool
        self._log = log if log is not None else logging.getLogger(__name__).warning
        self._logged = 0

    def close(self) -> None:
        self._pool.close()

    def _report(self, outcome: _Outcome, source: str) -> None:
        if outcome.status == "ok" or self._logged >= _MAX_LOGGED:
            return
        self._logged += 1
        what = (f"timed out after task.reward_timeout={self._pool.timeout:g} s" if outcome.status == "timeout"
                else f"failed: {outcome.detail}")
        more = "; later failures are counted in reward_errors / reward_timeouts, not logged"
        self._log(f"reward {self.name} {what} on {source or 'a row'}{more if self._logged == _MAX_LOGGED else ''}")

    @staticmethod
    def _counts(outcomes: Sequence[_Outcome]) -> dict[str, int]:
        return {"errors": sum(o.status == "error" for o in outcomes),
                "timeouts": sum(o.status == "timeout" for o in outcomes)}


class MathRewarder(_PooledRewarder):
    """The extracted final answer checked against the reference by math-verify, in the worker pool. Pairs
    whose verdict is plain (the same text; two plain numbers, compared exactly) need no call, and equal
    (reference, answer) pairs in a batch share one."""

    name = "math-verify"

    def score(self, problems: Sequence[Problem], responses: Sequence[str]) -> RewardBatch:
        answers = [extract_answer(r) for r in responses]
        refs = [reference_answer(p.answer) for p in problems]
        rows = [_plain_verdict(ref, ans) for ref, ans in zip(refs, answers, strict=True)]
        first: dict[tuple[str, str], int] = {}  # each pair to check, with the first row that has it
        for i, (ref, ans) in enumerate(zip(refs, answers, strict=True)):
            if rows[i] is None:
                first.setdefault((ref, ans), i)
        checked = dict(zip(first, self._pool.run(list(first)), strict=True))
        for pair, i in first.items():
            self._report(checked[pair], problems[i].source)
        rows = [o if o is not None else checked[(ref, ans)] for o, ref, ans in zip(rows, refs, answers, strict=True)]
        correct = np.asarray([o.status == "ok" and o.value >= 1.0 for o in rows], bool)
        return RewardBatch(correct.astype(np.float32), np.asarray([a is not None for a in answers], bool), correct,
                           **self._counts(rows))


class PythonRewarder(_PooledRewarder):
    """A user's ``fn(prompt, response, answer) -> float`` (task.reward_fn), one call per row in the pool."""

    def __init__(self, pool: _WorkerPool, spec: str, log: Callable[[str], None] | None):
        super().__init__(pool, log)
        self.name = spec

    def score(self, problems: Sequence[Problem], responses: Sequence[str]) -> RewardBatch:
        calls = [(_as_given(p.prompt), r, p.answer) for p, r in zip(problems, responses, strict=True)]
        outcomes = self._pool.run(calls)
        for o, p in zip(outcomes, problems, strict=True):
            self._report(o, p.source)
        ok = np.asarray([o.status == "ok" for o in outcomes], bool)
        rewards = np.asarray([o.value if o.status == "ok" else 0.0 for o in outcomes], np.float32)
        return RewardBatch(rewards, ok, ok & (rewards >= 1.0), **self._counts(outcomes))


def make_rewarder(task_cfg, task, *, log: Callable[[str], None] | None = None,
                  workers: int | None = None) -> Rewarder:
    """The reward ``task_cfg.reward`` names for ``task`` (exact, math or python; see the module docstring).

    With ``task.reward=python``, ``task.reward_fn="package.module:function"`` is called as
    ``function(prompt, response, answer) -> float`` (``prompt``: the row's string or list of chat messages)
    in a worker process, at most ``task.reward_timeout`` seconds a call. It is imported and checked here: a
    module that does not import, a missing or non-callable attribute, or one that does not take three
    arguments is a RewardFunctionError before any call. A call that raises, returns anything but a finite
    number, runs past the timeout (a worker that does not return is stopped and replaced) or kills its
    worker scores 0.0 (``format_ok`` and ``correct`` False) and counts in ``RewardBatch.errors`` or
    ``timeouts``; the first few are reported through ``log`` (default: this module's logger) with the
    function's name, the row's source and the exception. The job goes on either way.

    ``workers``: processes of the math / python pool (default: up to 4, one per core). Close the rewarder
    (or use it as a context manager) to stop them."""
    size = workers if workers is not None else min(4, os.cpu_count() or 1)
    if task_cfg.reward == "exact":
        return ExactRewarder(task)
    if task_cfg.reward == "math":
        if importlib.util.find_spec("math_verify") is None:
            raise RewardFunctionError('task.reward=math needs math-verify: pip install "math-verify>=0.8"')
        return MathRewarder(_WorkerPool("math", None, task_cfg.reward_timeout, size), log)
    if task_cfg.reward == "python":
        load_reward_fn(task_cfg.reward_fn)
        return PythonRewarder(_WorkerPool("python", task_cfg.reward_fn, task_cfg.reward_timeout, size),
                              task_cfg.reward_fn, log)
    raise ValueError(f"task.reward={task_cfg.reward!r}: expected exact, math or python")


def load_reward_fn(spec: str) -> Callable[..., Any]:
    """The function ``"package.module:function"`` names, checked to be a callable taking (prompt, response,
    answer); a RewardFunctionError naming the spec and the fix otherwise."""
    module_name, sep, attr = (spec or "").partition(":")
    if not (sep and module_name and attr):
        raise RewardFunctionError(f"task.reward_fn={spec!r}: expected 'package.module:function'")
    try:
        obj = importlib.import_module(module_name)
    except (Exception, SystemExit) as e:
        raise RewardFunctionError(f"task.reward_fn={spec!r}: module {module_name!r} does not import ({_describe(e)}): "
                                  "install it or put its folder on PYTHONPATH") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise RewardFunctionError(f"task.reward_fn={spec!r}: {module_name!r} has no attribute {attr!r}: name "
                                      "a function defined in the module")
        obj = getattr(obj, part)
    if not callable(obj):
        raise RewardFunctionError(f"task.reward_fn={spec!r} is {type(obj).__name__}, not callable: name a function "
                                  "fn(prompt, response, answer) -> float")
    try:
        inspect.signature(obj).bind(None, None, None)
    except TypeError:
        raise RewardFunctionError(f"task.reward_fn={spec!r} takes {inspect.signature(obj)}, not (prompt, response, "
                                  "answer): change its parameters") from None
    except ValueError:  # no signature to check (some builtins)
        pass
    return obj


# ---------------------------------------------------------------------------------------- answer extraction
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_BRACE = re.compile(r"[{}]")
_GSM8K = re.compile(r"####\s*\$?\s*(-?[0-9][0-9,]*(?:\.[0-9]+)?)")
_NUMBER = re.compile(r"(?<![\w.])-?(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]+)?(?:/[0-9]+)?")


def extract_answer(text: str) -> str | None:
    """The final answer in free-text reasoning: the content of the last closed, non-empty ``\\boxed{...}``
    (braces balanced), else the number after GSM8K's last ``####``, else the last number; None if none."""
    return _last_boxed(text) or _last_match(_GSM8K, text, group=1) or _last_match(_NUMBER, text)


def reference_answer(answer: str) -> str:
    """The part of a reference answer to compare with: its last ``\\boxed{}`` or ``#### N`` if it is a whole
    worked solution (MATH, GSM8K), else all of it, stripped."""
    return _last_boxed(answer) or _last_match(_GSM8K, answer, group=1) or answer.strip()


def _last_boxed(text: str) -> str | None:
    if "\\boxed" not in text and "\\fbox" not in text:
        return None
    closing, stack = {}, []
    for m in _BRACE.finditer(text):  # one pass over the braces: each "{" to its "}"
        if m.group() == "{":
            stack.append(m.start())
        elif stack:
            closing[stack.pop()] = m.start()
    for m in reversed(list(_BOXED.finditer(text))):
        end = closing.get(m.end() - 1)
        if end is not None and text[m.end():end].strip():
            return text[m.end():end].strip()
    return None


def _last_match(pattern: re.Pattern, text: str, group: int = 0) -> str | None:
    last = deque(pattern.finditer(text), maxlen=1)
    return last[0].group(group) if last else None


_PLAIN_NUMBER = re.compile(r"-?(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]+)?")
_PLAIN_FRACTION = re.compile(r"(-?)(?:\\[dt]?frac\{(-?[0-9]+)\}\{([0-9]+)\}"  # \frac{3}{4}, \dfrac{-3}{4}
                             r"|\\[dt]?frac([0-9])([0-9])|([0-9]+)/([0-9]+))")  # \frac34, 3/4


def _plain_verdict(reference: str, answer: str | None) -> _Outcome | None:
    """The verdict where it needs no math-verify call (None where it does): no answer is wrong, the same text
    is right, two plain numbers or fractions of equal value are right, two different integers (up to 15
    digits) are wrong. Other pairs go to math-verify (it allows rounding, forms, symbols)."""
    if answer is None or answer == reference:
        return _Outcome("ok", float(answer is not None))
    ref, ans = _plain_value(reference), _plain_value(answer)
    if ref is None or ans is None:
        return None
    if ref == ans:
        return _Outcome("ok", 1.0)
    if all(_PLAIN_NUMBER.fullmatch(t) and "." not in t and len(t) <= 15 for t in (reference, answer)):
        return _Outcome("ok", 0.0)
    return None


def _plain_value(text: str) -> Fraction | None:
    """The exact value of a plain number (``-1,234.5``) or fraction (``\\frac{3}{4}``, ``\\dfrac12``, ``3/4``)."""
    if _PLAIN_NUMBER.fullmatch(text):
        return Fraction(text.replace(",", ""))
    m = _PLAIN_FRACTION.fullmatch(text)
    if m is None:
        return None
    num, den = [int(g) for g in m.groups()[1:] if g is not None]
    return None if den == 0 else Fraction(-num if m.group(1) else num, den)


def _as_given(prompt: str | tuple) -> str | list[dict]:
    """A prompt as its row gave it: a string, or the chat messages as a list of dicts (copies)."""
    return prompt if isinstance(prompt, str) else [dict(m) for m in prompt]


# ---------------------------------------------------------------------------------------- worker pool
# A worker is a fresh interpreter (fork+exec, like multiprocessing's "spawn", but without re-importing the
# job's __main__, which would import JAX), with the parent's sys.path so a reward module importable in the job
# is importable there. It talks over one socket pair: init message -> "ready" (or "init_error"), then one
# (call id, args) message per call -> (call id, status, value, detail).
_BOOT = ("import json, sys; sys.path[:] = json.loads(sys.argv[1]); "
         "from nereus_jax.rl.rewards import _worker_main; _worker_main(int(sys.argv[2]))")


class _Worker:
    def __init__(self, init: tuple):
        parent, child = Pipe()
        self.proc = subprocess.Popen([sys.executable, "-c", _BOOT, json.dumps([str(p) for p in sys.path]),
                                      str(child.fileno())],
                                     pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL)
        child.close()
        self.conn: Connection = parent
        self.conn.send(init)
        self.ready = False
        self.call: int | None = None  # the call it is running
        self.deadline = time.monotonic() + _STARTUP_S

    def stop(self, kill: bool = False) -> None:
        kill = kill or not self.ready  # one still starting has nothing to finish
        if not kill:
            try:
                self.conn.send(None)
            except OSError:
                kill = True
        self.conn.close()
        if kill:
            self.proc.kill()
        try:
            self.proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class _WorkerPool:
    """``size`` worker processes running ``kind`` ("math": math-verify; "python": the function ``spec``
    names), started now and kept across batches; each call limited to ``timeout`` seconds."""

    def __init__(self, kind: str, spec: str | None, timeout: float, size: int):
        self.timeout = float(timeout)
        self._init = ("init", kind, spec, self.timeout)
        self._workers = [_Worker(self._init) for _ in range(max(1, size))]
        self._lock = threading.Lock()  # one batch at a time (the job may score from several threads)

    def run(self, calls: Sequence[tuple]) -> list[_Outcome]:
        """Each call's outcome, in order; hung workers are stopped and dead ones replaced on the way."""
        outcomes: list[_Outcome | None] = [None] * len(calls)
        with self._lock:
            if not self._workers:
                raise RuntimeError("the rewarder is closed")
            queue = deque(range(len(calls)))
            while queue or any(w.call is not None for w in self._workers):
                self._dispatch(queue, calls)
                self._wait(outcomes)
        return outcomes

    def close(self) -> None:
        with self._lock:
            for w in self._workers:
                w.stop()
            self._workers = []

    def _dispatch(self, queue: deque, calls: Sequence[tuple]) -> None:
        for k, w in enumerate(self._workers):
            if not (w.ready and w.call is None and queue):
                continue
            if w.proc.poll() is not None:  # died while idle
                self._replace(k)
                continue
            i = queue.popleft()
            try:
                w.conn.send((i, calls[i]))
            except OSError:
                queue.appendleft(i)
                self._replace(k)
                continue
            w.call, w.deadline = i, time.monotonic() + self.timeout + _GRACE_S

    def _wait(self, outcomes: list) -> None:
        active = {w.conn: w for w in self._workers if not w.ready or w.call is not None}
        if not active:
            return
        left = min(w.deadline for w in active.values()) - time.monotonic()
        for conn in wait(list(active), timeout=max(0.0, left)):
            self._receive(active[conn], outcomes)
        now = time.monotonic()
        for w in active.values():
            if w in self._workers and (not w.ready or w.call is not None) and w.deadline <= now:
                self._expire(w, outcomes)

    def _receive(self, w: _Worker, outcomes: list) -> None:
        try:
            msg = w.conn.recv()
        except (EOFError, OSError):
            code = w.proc.wait()
            if w.call is None:
                self._fail(f"a reward worker process exited (code {code}) before it started; its error is above")
            outcomes[w.call] = _Outcome("error", 0.0, f"the call killed its worker process (exit code {code})")
            self._replace(self._workers.index(w))
            return
        if msg[0] == "ready":
            w.ready = True
        elif msg[0] == "init_error":
            self._fail(msg[1])
        else:
            call, status, value, detail = msg
            assert call == w.call, (call, w.call)
            outcomes[call], w.call = _Outcome(status, value, detail), None

    def _expire(self, w: _Worker, outcomes: list) -> None:
        if not w.ready:
            self._fail(f"a reward worker process did not start within {_STARTUP_S:g} s")
        outcomes[w.call] = _Outcome("timeout", 0.0, "")
        self._replace(self._workers.index(w))

    def _replace(self, k: int) -> None:
        self._workers[k].stop(kill=True)
        self._workers[k] = _Worker(self._init)

    def _fail(self, message: str):
        for w in self._workers:
            w.stop(kill=True)
        self._workers = []
        raise RewardFunctionError(message)


# ---------------------------------------------------------------------------------------- worker process
class _CallTimeout(BaseException):
    """Raised in a worker when a call passes the timeout (a BaseException: ``except Exception`` in the reward
    code does not swallow it)."""


def _on_alarm(signum, frame):
    raise _CallTimeout


def _worker_main(fd: int) -> None:
    """A worker's life: set up the reward, then run calls until the parent closes the connection (or dies)."""
    conn = Connection(fd)
    with contextlib.suppress(EOFError, OSError):  # the parent went away
        _serve(conn, *conn.recv()[1:])


def _serve(conn: Connection, kind: str, spec: str | None, timeout: float) -> None:
    try:
        fn = _math_equal if kind == "math" else _checked(load_reward_fn(spec))
        if kind == "math":
            _setup_math()
    except BaseException as e:  # reported to the parent, which raises it
        conn.send(("init_error", str(e) if isinstance(e, RewardFunctionError) else _describe(e)))
        return
    signal.signal(signal.SIGALRM, _on_alarm)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the job, which then closes its workers
    conn.send(("ready",))
    while (msg := conn.recv()) is not None:
        call, args = msg
        try:
            status, value, detail = _timed(fn, args, timeout)
        except _CallTimeout:  # the alarm went off just after the call returned
            status, value, detail = "timeout", 0.0, ""
        conn.send((call, status, value, detail))


def _timed(fn: Callable[..., float], args: tuple, timeout: float) -> tuple[str, float, str]:
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        return "ok", fn(*args), ""
    except _CallTimeout:
        return "timeout", 0.0, ""
    except BaseException as e:  # SystemExit too: a reward call must not end its worker
        return "error", 0.0, _describe(e)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def _checked(fn: Callable[..., Any]) -> Callable[..., float]:
    """``fn`` whose result must be a finite real number (bools and numpy scalars count)."""

    def call(prompt, response, answer) -> float:
        value = fn(prompt, response, answer)
        if isinstance(value, numbers.Real) and math.isfinite(value):
            return float(value)
        raise TypeError(f"returned {reprlib.repr(value)} ({type(value).__name__}), not a finite number")

    return call


def _setup_math() -> None:
    """Imports and warms math-verify before the worker says "ready", so no call pays for that."""
    # Timeouts are this pool's (math-verify's own, disabled here, would reset the worker's alarm).
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    _math_equal("\\frac{1}{2}", "0.5")
    _math_equal("x^2+1", "1+x^2")


@functools.lru_cache(maxsize=4096)
def _parse_math(text: str) -> list:
    from math_verify import parse

    return parse(f"${text}$", parsing_timeout=None) or parse(text, parsing_timeout=None)


def _math_equal(reference: str, answer: str) -> float:
    from math_verify import verify

    return float(verify(_parse_math(reference), _parse_math(answer), timeout_seconds=None))


def _describe(e: BaseException) -> str:
    try:
        text = f"{type(e).__name__}: {e}"
    except Exception:  # an exception whose str() fails
        text = type(e).__name__
    return text if len(text) <= 300 else text[:297] + "..."
