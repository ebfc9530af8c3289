"""Tools and tool calls: the calculator against Python's arithmetic, tool-call parsing on hand-written well- and
ill-formed calls in each format, the python sandbox (runs code; refuses network, files outside its folder and
subprocesses; stops code past its timeout), and ToolEnv's answers, error and timeout counting."""

import threading

import pytest

from nereus_jax.config import ConfigError, load_config
from nereus_jax.rl.env import EnvError, ToolEnv, make_env
from nereus_jax.rl.tasks import Problem
from nereus_jax.rl.tools import (
    CALCULATOR,
    PYTHON,
    Tool,
    ToolError,
    ToolTimeout,
    calculate,
    parse_tool_calls,
    run_python,
)

TOOLS = {"calculator": CALCULATOR, "python": PYTHON}


@pytest.mark.parametrize("expr", ["12*34", "(12 + 7) * 34 - 5", "2**10", "7/2", "-3 % 5", "17 // 4", "1.5*4",
                                  "123456789 * 987654321"])
def test_calculator_equals_python_arithmetic(expr):
    want = eval(expr)  # the reference: Python's own arithmetic on these literals
    got = calculate(expr)
    assert (int(got) if "." not in got else float(got)) == want


@pytest.mark.parametrize("expr, why", [("__import__('os')", "only numbers"), ("1/0", "division by zero"),
                                       ("2**100000", "exponent"), ("x + 1", "only numbers"), ("1 +", "not an")])
def test_calculator_refuses_what_is_not_plain_arithmetic(expr, why):
    with pytest.raises(ToolError, match=why):
        calculate(expr)


def test_hermes_calls_parse_and_malformed_ones_carry_their_error():
    text = ('let me compute <tool_call>\n{"name": "calculator", "arguments": {"expression": "12*34"}}\n</tool_call>'
            '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>')
    calls = parse_tool_calls(text, "hermes", TOOLS)
    assert [(c.name, c.arguments, c.error) for c in calls] == [("calculator", {"expression": "12*34"}, None),
                                                               ("python", {"code": "print(1)"}, None)]
    bad = {"<tool_call>{not json}</tool_call>": "not valid JSON",
           '<tool_call>{"name": "search", "arguments": {}}</tool_call>': "no tool named 'search'",
           '<tool_call>{"arguments": {}}</tool_call>': "a tool call is a JSON object",
           '<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>': "not a JSON object",
           '<tool_call>{"name": "calculator", "arguments": {"expression": "1"}}': "not closed"}
    for text, why in bad.items():
        (call,) = parse_tool_calls(text, "hermes", TOOLS)
        assert call.error is not None and why in call.error, (text, call)
    assert parse_tool_calls("the answer is 408", "hermes", TOOLS) == []


def test_llama3_and_plain_calls_parse():
    (call,) = parse_tool_calls('<|python_tag|>{"name": "calculator", "parameters": {"expression": "2+2"}}', "llama3",
                               TOOLS)
    assert (call.name, call.arguments, call.error) == ("calculator", {"expression": "2+2"}, None)
    assert parse_tool_calls("408", "llama3", TOOLS) == []
    calls = parse_tool_calls("so [calculator: 12*34] and [search: x]", "plain", TOOLS)
    assert [(c.name, c.arguments) for c in calls] == [("calculator", {"expression": "12*34"}), ("search", {})]
    assert calls[0].error is None and "no tool named 'search'" in calls[1].error


def test_the_python_sandbox_runs_code_in_its_own_folder():
    assert run_python("print(sum(range(10)))", 30) == "45\n"
    assert run_python("open('x.txt', 'w').write('hi'); print(open('x.txt').read())", 30) == "hi\n"
    with pytest.raises(ToolError, match="ZeroDivisionError"):
        run_python("1/0", 30)


@pytest.mark.parametrize("code, why", [
    ("import socket; socket.create_connection(('127.0.0.1', 80))", "socket"),
    ("import urllib.request; urllib.request.urlopen('http://127.0.0.1:9')", "socket"),
    ("print(open('/etc/passwd').read())", "no access"),
    ("open('/tmp/nereus-sandbox-escape', 'w')", "no access"),
    ("import os; print(os.listdir('/'))", "no access"),
    ("import subprocess; subprocess.run(['ls'])", "subprocess"),
    ("import os; os.system('ls')", "os.system"),
    ("import ctypes; ctypes.CDLL(None)", "ctypes"),
])
def test_the_python_sandbox_refuses_network_files_outside_and_subprocesses(code, why):
    with pytest.raises(ToolError, match=why):
        run_python(code, 30)


def test_the_python_sandbox_stops_code_past_its_timeout():
    with pytest.raises(ToolTimeout):
        run_python("while True: pass", 1.0)


def test_tool_env_answers_calls_and_counts_errors_and_timeouts():
    hang = threading.Event()
    stuck = Tool("stuck", "never returns", {"type": "object", "properties": {}},
                 lambda args, timeout: hang.wait() and "", "x")
    env = ToolEnv([CALCULATOR, stuck], "hermes", timeout=0.2)
    msgs = env.reset(Problem("what is 12*34?", "408"))
    assert msgs == [{"role": "user", "content": "what is 12*34?"}]
    text = ('<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>'
            '<tool_call>{"name": "calculator", "arguments": {"expression": "1/0"}}</tool_call>'
            '<tool_call>{"name": "stuck", "arguments": {}}</tool_call><tool_call>nope</tool_call>')
    out = env.step(msgs, {"role": "assistant", "content": text})
    hang.set()
    assert not out.done and out.reward is None
    assert [m["content"] for m in out.messages] == [
        "408", "error: division by zero", "error: the tool ran past 0.2 s and was stopped",
        "error: the tool call is not valid JSON (Expecting value at character 0)"]
    assert (out.tool_calls, out.tool_errors, out.tool_timeouts) == (4, 2, 1)
    done = env.step(msgs, {"role": "assistant", "content": "the answer is 408"})
    assert done.done and done.messages == []


def test_env_settings_are_checked_with_the_fix():
    cfg = load_config(None, ["task.env=tools", "task.tools=[calculator,search]"])
    with pytest.raises(EnvError, match="built-in tools are"):
        make_env(cfg.task, "hermes", 1.0)
    with pytest.raises(EnvError, match="neither a built-in"):
        make_env(load_config(None, ["task.env=nothing"]).task, "hermes", 1.0)
    with pytest.raises(EnvError, match="must be importable"):
        make_env(load_config(None, ["task.env=no_such_module:Env"]).task, "hermes", 1.0)
    with pytest.raises(ConfigError, match="max_total_length"):
        load_config(None, ["rollout.max_total_length=1000"])
    assert isinstance(make_env(load_config(None, ["task.env=python"]).task, "plain", 1.0), ToolEnv)


def test_the_python_sandbox_refuses_the_modules_behind_subprocess_and_ctypes():
    for module in ("_posixsubprocess", "_ctypes"):
        with pytest.raises(ToolError, match=f"importing {module}"):
            run_python(f"import {module}", 30)
