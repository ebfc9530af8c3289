"""Tasks with verifiable rewards: generated on the fly, or read from a prompt file (JSONL or Parquet).

A task maps a data position (a non-negative index into the training stream) to a problem
deterministically, so a resumed or re-laid-out run sees exactly the same prompts; held-out problems come
from a separate stream (or file) and never appear in training.

    task = make_task(cfg.task, seed=0)
    p = task.problem(17)                   # Problem(prompt='12+34=', answer='46')
    task.reward(p, '46')                   # 1.0

A prompt file holds one row per problem; ``task.prompt_key`` / ``task.answer_key`` name the fields (dotted
paths reach into nested objects), so verl-style rows load as they are::

    {"prompt": [{"role": "user", "content": "What is 6*7?"}], "reward_model": {"ground_truth": "42"}}
    task.name=file task.prompt_file=train.parquet task.prompt_key=prompt task.answer_key=reward_model.ground_truth

A prompt is a string or a list of chat messages ({"role", "content"} strings); a number answer becomes a
string. Every unusable row is a :class:`PromptDataError` naming the file, the row and the field.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

_EVAL_SEED_OFFSET = 1_000_003


Message = Mapping[str, Any]  # a chat message: string "role" and "content" (other keys kept as the row gave them)


@dataclass(frozen=True)
class Problem:
    prompt: str | tuple[Message, ...]  # text, or chat messages for the tokenizer's chat template
    answer: str  # a reference answer (the supervised warm start trains on it)
    source: str = ""  # where the problem came from, for messages: "data.jsonl:17", "data.parquet:row 16"


class PromptDataError(ValueError):
    """A prompt file that cannot be used; the message names the file, the row, the field and the fix."""


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
    """Problems from a prompt file (JSONL or Parquet); reward 1 when the response (stripped) equals the answer.

    Held out: every row of ``eval_file`` if given, else the last ``eval_size`` rows of ``path`` (at most half).
    ``problem(index)`` cycles through the training rows in file order."""

    name = "file"

    def __init__(self, path: str, eval_size: int = 256, *, prompt_key: str = "prompt", answer_key: str = "answer",
                 eval_file: str | None = None):
        self.path = path
        problems = load_prompt_file(path, prompt_key, answer_key)
        if eval_file is not None:
            self._train = problems
            self._eval = load_prompt_file(eval_file, prompt_key, answer_key, setting="task.eval_file")
            return
        if eval_size > 0 and len(problems) < 2:
            raise PromptDataError(f"{path}: needs at least 2 problems (training and held-out), found "
                                  f"{len(problems)}: add rows, set task.eval_file, or set task.eval_size=0")
        held = min(eval_size, len(problems) // 2)
        self._train, self._eval = problems[: len(problems) - held], problems[len(problems) - held:]

    def problem(self, index: int) -> Problem:
        return self._train[index % len(self._train)]

    def eval_problems(self) -> list[Problem]:
        return list(self._eval)

    @property
    def num_train(self) -> int:
        """How many training problems the stream cycles through."""
        return len(self._train)

    def reward(self, problem: Problem, response: str) -> float:
        return float(response.strip() == problem.answer.strip())

    def drop_prompts(self, keep: Callable[[Problem], bool]) -> list[Problem]:
        """Removes the training and held-out problems for which ``keep`` is false (e.g. prompts longer than
        the model takes) and returns them, training ones first. ``problem(index)`` then cycles through the
        kept rows in file order, so it stays deterministic. An error if no training problem is kept."""
        train = [(p, keep(p)) for p in self._train]
        held = [(p, keep(p)) for p in self._eval]
        if not any(k for _, k in train):
            raise PromptDataError(f"{self.path}: all {len(train)} training prompts were dropped (longer than "
                                  "rollout.max_prompt_length with task.overlong=drop): raise "
                                  "rollout.max_prompt_length or shorten the prompts")
        self._train = [p for p, k in train if k]
        self._eval = [p for p, k in held if k]
        return [p for p, k in train + held if not k]


def load_prompt_file(path: str, prompt_key: str = "prompt", answer_key: str = "answer", *,
                     setting: str = "task.prompt_file") -> list[Problem]:
    """Every row of a JSONL or Parquet prompt file as a Problem; any unusable input is a PromptDataError
    naming the file, the row and the field, and saying what to change (``setting``: the key that named it)."""
    if not os.path.exists(path):
        raise PromptDataError(f"prompt file {path!r} does not exist: set {setting} to a local JSONL or Parquet file")
    if os.path.isdir(path):
        raise PromptDataError(f"prompt file {path!r} is a directory: set {setting} to a JSONL or Parquet file in it")
    keys = {"prompt": prompt_key, "answer": answer_key}
    rows = _parquet_rows(path, keys) if _is_parquet(path) else _jsonl_rows(path)
    problems = [_problem(where, row, keys) for where, row in rows]
    if not problems:
        raise PromptDataError(f"prompt file {path!r} is empty: it needs one row per problem with the fields "
                              f"{prompt_key!r} (task.prompt_key) and {answer_key!r} (task.answer_key)")
    return problems


def _is_parquet(path: str) -> bool:
    with open(path, "rb") as f:
        return path.endswith((".parquet", ".pq")) or f.read(4) == b"PAR1"


def _jsonl_rows(path: str) -> Iterator[tuple[str, Any]]:
    """(``path:line``, parsed object) for each non-blank line of a JSONL file."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            where = f"{path}:{number}"
            if b"\0" in raw:
                raise PromptDataError(f"{where}: binary data, not JSONL text: give a JSONL file (one JSON object "
                                      "a line) or a .parquet file")
            try:
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise PromptDataError(f"{where}: not UTF-8 text (byte {e.start} of the line): save the file as "
                                      "UTF-8") from None
            if line.strip():
                yield where, _json_object(where, line)


def _json_object(where: str, line: str) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        raise PromptDataError(f"{where}: not valid JSON ({e.msg}, column {e.colno}); each line must be one JSON "
                              'object like {"prompt": "2+2=", "answer": "4"}') from None


def _parquet_rows(path: str, keys: Mapping[str, str]) -> Iterator[tuple[str, Any]]:
    """(``path:row i``, row as a dict) for each row of a Parquet file, reading only the columns the keys use."""
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:
        raise PromptDataError(f'{path}: reading Parquet needs pyarrow: pip install "nereus-jax[parquet]"') from None
    try:
        parquet = pyarrow.parquet.ParquetFile(path)
    except (pyarrow.ArrowException, OSError) as e:
        raise PromptDataError(f"{path}: not a readable Parquet file ({e}): give a Parquet or JSONL file") from None
    names = parquet.schema_arrow.names
    columns = []
    for what, key in keys.items():
        column = key if key in names else key.split(".")[0]
        if column not in names:
            raise PromptDataError(f"{path}: no column {column!r} for the {what} (task.{what}_key={key!r}); the "
                                  f"columns are {names}: set task.{what}_key to the {what}'s field")
        columns.append(column)
    index = 0
    for batch in parquet.iter_batches(columns=list(dict.fromkeys(columns))):
        for row in batch.to_pylist():
            yield f"{path}:row {index}", row
            index += 1


def _problem(where: str, row: Any, keys: Mapping[str, str]) -> Problem:
    if not isinstance(row, dict):
        raise PromptDataError(f"{where}: expected a JSON object like {{\"prompt\": \"2+2=\", \"answer\": \"4\"}}, "
                              f"got {_kind(row)}")
    return Problem(_prompt(where, keys["prompt"], _field(where, row, keys["prompt"], "prompt")),
                   _answer(where, keys["answer"], _field(where, row, keys["answer"], "answer")), where)


def _field(where: str, row: dict, key: str, what: str) -> Any:
    """``row[key]``, a dotted ``key`` reaching into nested objects (a field literally named ``key`` first)."""
    if key in row:
        value = row[key]
    else:
        value, parts = row, key.split(".")
        for depth, part in enumerate(parts):
            if not isinstance(value, dict) or part not in value:
                found = ".".join(parts[:depth]) or "the row"
                has = f"has fields {sorted(value)}" if isinstance(value, dict) else f"is {_kind(value)}"
                example = {"prompt": "question", "answer": "reward_model.ground_truth"}[what]
                raise PromptDataError(f"{where}: no field {key!r} ({found} {has}): set task.{what}_key to the "
                                      f"field holding the {what}, e.g. task.{what}_key={example}")
            value = value[part]
    if value is None:
        raise PromptDataError(f"{where}: field {key!r} is null: give every row its {what}, or drop the row")
    return value


def _prompt(where: str, key: str, value: Any) -> str | tuple[Message, ...]:
    if isinstance(value, str):
        if not value.strip():
            raise PromptDataError(f"{where}: field {key!r} is an empty prompt: fill it in or drop the row")
        return value
    if not isinstance(value, list):
        raise PromptDataError(f"{where}: field {key!r} is {_kind(value)}, expected a string or a list of chat "
                              'messages like [{"role": "user", "content": "..."}]')
    for i, m in enumerate(value):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise PromptDataError(f"{where}: field {key!r} message {i} is {_short(m)}; each message needs string "
                                  '"role" and "content", like {"role": "user", "content": "..."}')
    if not any(m["content"].strip() for m in value):
        raise PromptDataError(f"{where}: field {key!r} is an empty prompt (no message has content): fill it in or "
                              "drop the row")
    return tuple(value)


def _answer(where: str, key: str, value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)
    raise PromptDataError(f"{where}: field {key!r} is {_kind(value)} {_short(value)}, expected a string or a "
                          "number: set task.answer_key to the reference answer's field")


def _kind(value: Any) -> str:
    """A JSON value's type in JSON's words."""
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number" if isinstance(value, int | float) else type(value).__name__)


def _short(value: Any) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, float) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def make_task(task_cfg, seed: int = 0):
    """The task a TaskConfig names."""
    if task_cfg.name == "file":
        return PromptFileTask(task_cfg.prompt_file, task_cfg.eval_size, prompt_key=task_cfg.prompt_key,
                              answer_key=task_cfg.answer_key, eval_file=task_cfg.eval_file)
    cls = {"addition": AdditionTask, "sorting": SortingTask, "countdown": CountdownTask,
           "copy": CopyTask}[task_cfg.name]
    return cls(seed=seed, eval_size=task_cfg.eval_size, num_digits=task_cfg.num_digits)
