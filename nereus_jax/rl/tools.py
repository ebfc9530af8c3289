"""Tools an agent calls, and the model's tool calls parsed from its chat format.

A :class:`Tool` is a name, a description, a JSON schema of its arguments (what the chat template shows the
model, as transformers' ``apply_chat_template(..., tools=[...])`` takes it) and a function from the arguments
to the text the model reads back. Built-ins: ``calculator`` (arithmetic, evaluated on the syntax tree, never
``eval``) and ``python`` (a script in a sandboxed subprocess: its own scratch folder, a time and memory limit,
no network, no files outside the folder, no subprocesses).

Formats of a call in the model's text (``parse_tool_calls``):

- ``hermes``: Qwen3 / Hermes, ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (several allowed);
- ``llama3``: Llama 3.1, the message is one JSON object ``{"name": ..., "parameters": {...}}``, optionally
  after ``<|python_tag|>``;
- ``plain``: for tokenizers without a chat template (the built-in character tokenizer), ``[name: argument]``
  with the tool's single string argument, e.g. ``[calculator: 12*34]``.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import math
import operator
import os
import re
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

FORMATS = ("hermes", "llama3", "plain")


class ToolError(Exception):
    """A tool's own failure (bad arguments, an error in the code it ran): its text goes back to the model."""


class ToolTimeout(ToolError):
    """The tool ran past its time limit."""


@dataclasses.dataclass(frozen=True)
class Tool:
    """A callable tool: ``run(arguments, timeout)`` returns the text the model reads (raises ToolError)."""

    name: str
    description: str
    parameters: Mapping[str, Any]  # JSON schema of the arguments object
    run: Callable[[Mapping[str, Any], float], str]
    main_argument: str  # the argument the plain format's ``[name: text]`` fills

    def schema(self) -> dict[str, Any]:
        """The tool as chat templates take it (OpenAI / transformers function-calling schema)."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": dict(self.parameters)}}


class ToolCall(NamedTuple):
    name: str
    arguments: dict[str, Any]
    error: str | None = None  # a malformed call: what is wrong with it (the model is told)


# ------------------------------------------------------------------------------------------ calculator
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_MAX_EXPONENT = 64
_MAX_DIGITS = 400


def calculate(expression: str) -> str:
    """The value of an arithmetic expression (+ - * / // % ** and parentheses on numbers), as text: integers
    exactly, other results with Python's repr of a float. Anything else is a ToolError."""
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ToolError(f"not an arithmetic expression: {expression!r}") from e

    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            a, b = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(b) > _MAX_EXPONENT:
                raise ToolError(f"exponent {b} is too large (at most {_MAX_EXPONENT})")
            try:
                out = _BINARY[type(node.op)](a, b)
            except ZeroDivisionError as e:
                raise ToolError("division by zero") from e
            if isinstance(out, int) and len(str(abs(out))) > _MAX_DIGITS:
                raise ToolError(f"result has more than {_MAX_DIGITS} digits")
            return out
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](value(node.operand))
        raise ToolError(f"only numbers and + - * / // % ** ( ) are allowed, got {ast.unparse(node)!r}")

    out = value(tree.body)
    if isinstance(out, float):
        if not math.isfinite(out):
            raise ToolError("the result is not finite")
        if out.is_integer() and abs(out) < 2**53:
            return str(int(out))
    return str(out)


def _calculator(arguments: Mapping[str, Any], timeout: float) -> str:
    expression = arguments.get("expression")
    if not isinstance(expression, str):
        raise ToolError('calculator takes {"expression": "<arithmetic>"}')
    return calculate(expression)


CALCULATOR = Tool("calculator", "Evaluates an arithmetic expression (+ - * / // % ** and parentheses).",
                  {"type": "object", "properties": {"expression": {"type": "string",
                                                                   "description": "e.g. (12 + 7) * 34"}},
                   "required": ["expression"]}, _calculator, "expression")


# ------------------------------------------------------------------------------------------ python sandbox
# Runs first in the child, before the user's code: an audit hook (which the code cannot remove) refuses
# sockets, subprocesses, native-library loading and files outside the scratch folder and Python's own. It
# guards against a policy's mistakes (a stray rm, a download), not against code written to escape: run
# untrusted environments' code in a container or VM as well.
_PRELUDE = r"""
import os, sys
_root = os.path.realpath(os.getcwd())
_read = tuple(os.path.realpath(p) for p in {prefixes!r})
def _inside(path, roots):
    try:
        p = os.path.realpath(os.fspath(path)) if not isinstance(path, int) else None
    except Exception:
        return False
    return p is None or any(p == r or p.startswith(r + os.sep) for r in roots)
_deny = ("socket.", "subprocess.", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
         "os.forkpty", "ctypes.", "pty.", "os.kill", "os.killpg", "signal.pthread_kill", "sys._current_frames")
def _hook(event, args):
    if event == "import" and args[0] in ("_posixsubprocess", "_ctypes"):
        raise PermissionError(f"sandbox: importing {{args[0]}} is not allowed")
    if event.startswith(_deny) and event != "socket.gethostname":
        raise PermissionError(f"sandbox: {{event}} is not allowed")
    if event == "open":
        path, mode = args[0], args[1] or "r"
        writing = any(c in str(mode) for c in "wax+")
        if not _inside(path, (_root,) if writing else (_root,) + _read):
            raise PermissionError(f"sandbox: no access to {{path}}")
    elif event in ("os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.symlink", "os.link",
                   "os.truncate", "os.chown", "shutil.rmtree", "os.chdir", "os.listdir", "os.scandir"):
        roots = (_root,) + _read if event in ("os.listdir", "os.scandir") else (_root,)
        for path in args[:2]:
            if isinstance(path, (str, bytes, os.PathLike)) and not _inside(path, roots):
                raise PermissionError(f"sandbox: no access to {{path}}")
sys.addaudithook(_hook)
del _hook
"""


def _limit_resources(memory_bytes: int, cpu_seconds: int):
    def apply():  # in the child, before exec
        import resource  # noqa: PLC0415 - POSIX only

        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds + 1))
        resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 20, 16 << 20))
        os.setsid()
    return apply


def run_python(code: str, timeout: float, *, memory_bytes: int = 1 << 30, max_output: int = 2000) -> str:
    """Runs ``code`` in a fresh, isolated interpreter (``python -I``) in a scratch folder deleted afterwards;
    returns its stdout (and stderr when it failed), cut to ``max_output`` characters. A run past ``timeout``
    seconds is killed (ToolTimeout); a non-zero exit is a ToolError carrying its stderr."""
    prefixes = sorted({sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix})
    prelude = _PRELUDE.format(prefixes=prefixes)
    with tempfile.TemporaryDirectory(prefix="nereus-sandbox-") as scratch:
        env = {"PATH": "/usr/bin:/bin", "HOME": scratch, "TMPDIR": scratch, "PYTHONDONTWRITEBYTECODE": "1",
               "NO_PROXY": "*", "http_proxy": "http://0.0.0.0:9", "https_proxy": "http://0.0.0.0:9"}
        try:
            proc = subprocess.run([sys.executable, "-I", "-c", prelude + "\n" + f"exec(compile({code!r}, "
                                   "'<tool>', 'exec'), {'__name__': '__main__'})"],
                                  cwd=scratch, env=env, capture_output=True, text=True, timeout=timeout,
                                  preexec_fn=_limit_resources(memory_bytes, math.ceil(timeout) + 1))
        except subprocess.TimeoutExpired as e:
            raise ToolTimeout(f"the code ran past {timeout:g} s and was stopped") from e
    out = proc.stdout
    if proc.returncode in (-signal.SIGXCPU, -signal.SIGKILL):  # its CPU-time limit (the wall-clock one's twin)
        raise ToolTimeout(f"the code ran past {timeout:g} s of CPU time and was stopped")
    if proc.returncode != 0:
        err = proc.stderr.strip().splitlines()
        raise ToolError(((out + "\n" if out else "") + "\n".join(err[-8:]))[:max_output])
    return out[:max_output]


def _python(arguments: Mapping[str, Any], timeout: float) -> str:
    code = arguments.get("code")
    if not isinstance(code, str):
        raise ToolError('python takes {"code": "<a Python script>"}')
    return run_python(code, timeout)


PYTHON = Tool("python", "Runs a Python script and returns what it prints (no network, no files outside its "
              "own folder).", {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
              _python, "code")

BUILTIN_TOOLS: dict[str, Tool] = {t.name: t for t in (CALCULATOR, PYTHON)}


# ------------------------------------------------------------------------------------------ parsing
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_HERMES_OPEN = re.compile(r"<tool_call>(?!.*</tool_call>)", re.DOTALL)
_PLAIN = re.compile(r"\[([a-z_][a-z0-9_]*):\s?([^\]]*)\]")


def parse_tool_calls(text: str, fmt: str, tools: Mapping[str, Tool]) -> list[ToolCall]:
    """The tool calls in an assistant message written in ``fmt`` (see the module docstring). A call that
    names no offered tool, is not valid JSON, or has arguments that are not an object comes back with
    ``error`` set; a message without calls gives []."""
    if fmt == "hermes":
        calls = [_json_call(body, "arguments", tools) for body in _HERMES.findall(text)]
        if _HERMES_OPEN.search(text):
            calls.append(ToolCall("", {}, "a <tool_call> is not closed by </tool_call>"))
        return calls
    if fmt == "llama3":
        body = text.split("<|python_tag|>", 1)[1] if "<|python_tag|>" in text else text
        body = body.strip()
        if not body.startswith("{"):
            return []
        return [_json_call(body, "parameters", tools)]
    if fmt == "plain":
        out = []
        for name, arg in _PLAIN.findall(text):
            tool = tools.get(name)
            out.append(ToolCall(name, {tool.main_argument: arg} if tool else {},
                                None if tool else f"no tool named {name!r} (tools: {', '.join(tools)})"))
        return out
    raise ValueError(f"tool-call format must be one of {FORMATS}, got {fmt!r}")


def _json_call(body: str, key: str, tools: Mapping[str, Tool]) -> ToolCall:
    try:
        call = json.loads(body)
    except json.JSONDecodeError as e:
        return ToolCall("", {}, f"the tool call is not valid JSON ({e.msg} at character {e.pos})")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return ToolCall("", {}, 'a tool call is a JSON object {"name": ..., "' + key + '": {...}}')
    name, args = call["name"], call.get(key, call.get("arguments", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return ToolCall(name, {}, f"the arguments of {name!r} are not a JSON object")
    if not isinstance(args, dict):
        return ToolCall(name, {}, f"the arguments of {name!r} are not a JSON object")
    if name not in tools:
        return ToolCall(name, args, f"no tool named {name!r} (tools: {', '.join(tools)})")
    return ToolCall(name, args)


def result_text(fmt: str, text: str) -> str:
    """The plain format's rendering of a tool's output (chat formats use the template's tool message)."""
    return f"[result: {text.strip()}]" if fmt == "plain" else text
