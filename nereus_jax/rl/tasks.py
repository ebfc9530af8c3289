"""Tasks with verifiable rewards, generated on the fly, and prompt files (JSONL with prompt and answer).

A task maps a data position (a non-negative index into the training stream) to a problem
deterministically, so a resumed or re-laid-out run sees exactly the same prompts; held-out problems come
from a separate stream and never appear in training.

    task = make_task(cfg.task, seed=0)
    p = task.problem(17)                   # Problem(prompt='12+34=', answer='46')
    task.reward(p, '46')                   # 1.0
"""

from __future__ import annotations

import json
import os
import random
import re
from dataclasses import dataclass

_EVAL_SEED_OFFSET = 1_000_003


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str  # a reference answer (the supervised warm start trains on it)


class PromptDataError(ValueError):
    """A prompt file that cannot be used; the message names the file, the line and the fix."""


class _GeneratedTask:
    """Base of the built-in tasks: problems from per-index RNGs; held-out set excluded from training."""

    name = "generated"

    def __init__(self, seed: int = 0, eval_size: int = 256):
        self.seed = seed
        self._eval = [self._make(random.Random(f"{seed}/{_EVAL_SEED_OFFSET}/{i}")) for i in range(eval_size)]
        self._eval_prompts = {p.prompt for p in self._eval}

    def problem(self, index: int) -> Problem:
        for attempt in range(1000):
            p = self._make(random.Random(f"{self.seed}/{index}/{attempt}"))
            if p.prompt not in self._eval_prompts:
                return p
        raise ValueError(f"task.eval_size={len(self._eval)} holds out (nearly) every {self.name} problem: "
                         "lower task.eval_size or raise task.num_digits")

    def eval_problems(self) -> list[Problem]:
        return list(self._eval)

    def reward(self, problem: Problem, response: str) -> float:
        return float(response.strip() == problem.answer)

    def _make(self, rng: random.Random) -> Problem:
        raise NotImplementedError


class AdditionTask(_GeneratedTask):
    """``a+b=`` with ``num_digits``-digit operands; reward 1 for the exact sum."""

    name = "addition"

    def __init__(self, seed: int = 0, eval_size: int = 256, num_digits: int = 2):
        self.num_digits = num_digits
        super().__init__(seed, eval_size)

    def _make(self, rng):
        hi = 10 ** self.num_digits - 1
        a, b = rng.randint(0, hi), rng.randint(0, hi)
        return Problem(f"{a}+{b}=", str(a + b))


class SortingTask(_GeneratedTask):
    """``sort:31415=`` -> ``11345``; reward 1 for the exactly sorted digits."""

    name = "sorting"

    def __init__(self, seed: int = 0, eval_size: int = 256, num_digits: int = 5):
        self.num_digits = num_digits
        super().__init__(seed, eval_size)

    def _make(self, rng):
        digits = "".join(rng.choice("0123456789") for _ in range(self.num_digits))
        return Problem(f"sort:{digits}=", "".join(sorted(digits)))


class CopyTask(_GeneratedTask):
    """``copy:4071=`` -> ``4071``: copy a digit string whose length has a long tail (most are short, a few
    are up to ``num_digits`` long: P(length > n) ~ 1/n), the shape of reasoning-length distributions that
    makes a generation step wait for its longest response."""

    name = "copy"

    def __init__(self, seed: int = 0, eval_size: int = 256, num_digits: int = 16):
        self.num_digits = num_digits
        super().__init__(seed, eval_size)

    def _make(self, rng):
        length = min(self.num_digits, int(1.0 / (1.0 - rng.random())))  # Pareto(1): P(L >= n) = 1/n
        digits = "".join(rng.choice("0123456789") for _ in range(length))
        return Problem(f"copy:{digits}=", digits)


class CountdownTask(_GeneratedTask):
    """``3,5,7>22=``: an expression using each given number at most once with + - * reaching the target."""

    name = "countdown"

    def __init__(self, seed: int = 0, eval_size: int = 256, num_digits: int = 3):
        self.count = max(num_digits, 2)
        super().__init__(seed, eval_size)

    def _make(self, rng):
        nums = [rng.randint(1, 9) for _ in range(self.count)]
        expr = str(nums[0])
        for n in nums[1:]:
            expr = f"{expr}{rng.choice('+-*')}{n}"
        return Problem(f"{','.join(map(str, nums))}>{_safe_eval(expr)}=", expr)

    def reward(self, problem: Problem, response: str) -> float:
        nums_text, target = problem.prompt.rstrip("=").split(">")
        expr = response.strip()
        if not re.fullmatch(r"[0-9+\-*()]+", expr):
            return 0.0
        used = sorted(int(x) for x in re.findall(r"\d+", expr))
        available = sorted(int(x) for x in nums_text.split(","))
        if not _is_submultiset(used, available):
            return 0.0
        value = _safe_eval(expr)
        return float(value is not None and value == int(target))


def _is_submultiset(used: list[int], available: list[int]) -> bool:
    pool = list(available)
    for x in used:
        if x not in pool:
            return False
        pool.remove(x)
    return True


def _safe_eval(expr: str) -> int | None:
    """Evaluates an expression of digits, + - * and parentheses (validated first); None if malformed."""
    if not re.fullmatch(r"[0-9+\-*()]+", expr):
        return None
    try:
        return int(eval(expr, {"__builtins__": {}}, {}))  # noqa: S307 - the regex admits arithmetic only
    except (SyntaxError, TypeError, ZeroDivisionError, ValueError):
        return None


class PromptFileTask:
    """Prompts from a JSONL file, one ``{"prompt": ..., "answer": ...}`` object a line; reward 1 when the
    response (stripped) equals the answer. The last ``eval_size`` lines are held out."""

    name = "file"

    def __init__(self, path: str, eval_size: int = 256):
        problems = load_prompt_file(path)
        if len(problems) < 2:
            raise PromptDataError(f"{path}: needs at least 2 problems (training and held-out), found {len(problems)}")
        held = min(eval_size, len(problems) // 2)
        self._train, self._eval = problems[: len(problems) - held], problems[len(problems) - held:]

    def problem(self, index: int) -> Problem:
        return self._train[index % len(self._train)]

    def eval_problems(self) -> list[Problem]:
        return list(self._eval)

    def reward(self, problem: Problem, response: str) -> float:
        return float(response.strip() == problem.answer.strip())


def load_prompt_file(path: str) -> list[Problem]:
    """Reads a JSONL prompt file; every problem a clear error naming the line and the fix."""
    if not os.path.exists(path):
        raise PromptDataError(f"prompt file {path!r} does not exist: set task.prompt_file to a local JSONL file")
    problems = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if line.strip():
                problems.append(_parse_line(path, number, line))
    if not problems:
        raise PromptDataError(f"prompt file {path!r} is empty: it needs one JSON object a line with "
                              '"prompt" and "answer"')
    return problems


def _parse_line(path: str, number: int, line: str) -> Problem:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise PromptDataError(f"{path}:{number}: not valid JSON ({e.msg}); each line must be one JSON object "
                              'like {"prompt": "2+2=", "answer": "4"}') from None
    if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str) or not isinstance(obj.get("answer"), str):
        raise PromptDataError(f'{path}:{number}: needs string fields "prompt" and "answer", got {line.strip()[:80]}')
    if not obj["prompt"]:
        raise PromptDataError(f"{path}:{number}: empty prompt")
    return Problem(obj["prompt"], obj["answer"])


def make_task(task_cfg, seed: int = 0):
    """The task a TaskConfig names."""
    if task_cfg.name == "file":
        return PromptFileTask(task_cfg.prompt_file, task_cfg.eval_size)
    cls = {"addition": AdditionTask, "sorting": SortingTask, "countdown": CountdownTask,
           "copy": CopyTask}[task_cfg.name]
    return cls(seed=seed, eval_size=task_cfg.eval_size, num_digits=task_cfg.num_digits)
