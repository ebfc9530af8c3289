"""Every bad input to a command-line entry point fails the same way: exit status 2, exactly one line on stderr
that names the flag, key or file to change, no traceback, nothing on stdout and nothing written.

One table, one row per bad input. To cover another CLI (``train``, ``export``), add rows: ``bad(name, cli,
argv, *expected substrings, files={path: text | bytes | None (a folder)})``. Each row runs in an empty working
directory holding only its ``files``; any file or folder the CLI leaves there (a run directory, a plot) fails
the row. Most rows call ``nereus_jax.<cli>.main(argv)`` in this process (a bad input must fail before any
heavy work, so they are fast); rows with ``subprocess=True`` run ``python -m nereus_jax.<cli>`` to prove that
nothing escapes the real entry point as a traceback.
"""

from __future__ import annotations

import copy
import importlib
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from nereus_jax.sim import load_trace

REPO = Path(__file__).resolve().parents[1]
FOLDER = None  # a ``files`` value: make a directory
DROP = object()  # a trace change: remove the key

# A valid, small trace: every simulate row changes one thing of it.
TRACE = {
    "name": "bad_input", "hardware": "a100", "models": "qwen2.5-0.5b", "algorithm": "ppo", "steps": 2, "seed": 0,
    "workload": {"prompts_per_step": 64, "samples_per_prompt": 1, "packed": True,
                 "prompt_length": {"mean": 128, "p95": 256, "max": 512}},
    "response_length": {"max_over_p95": 1.15, "jitter": 0.0, "keyframes": [{"step": 0, "mean": 500, "p95": 600}]},
    "pool": [{"step": 0, "devices": 4}],
    "controller": {"gamma": 0.5},
}


@dataclass(frozen=True)
class Bad:
    name: str
    cli: str                                           # module under nereus_jax: plan, simulate, ...
    argv: tuple[str, ...]
    expect: tuple[str, ...]                            # each must appear in the one error line
    files: tuple[tuple[str, str | bytes | None], ...]  # created in the working directory before the run
    subprocess: bool = False


def bad(name: str, cli: str, argv: list[str], *expect: str, files: dict | None = None, subprocess: bool = False):
    row = Bad(name, cli, tuple(argv), expect, tuple((files or {}).items()), subprocess)
    return pytest.param(row, id=f"{cli}-{name}")


def trace_yaml(changes: dict) -> str:
    """TRACE with dotted keys changed (``{"workload.prompts_per_step": 0}``; DROP removes one), as YAML."""
    data = copy.deepcopy(TRACE)
    for dotted, value in changes.items():
        *parents, last = dotted.split(".")
        node = data
        for key in parents:
            node = node[key]
        if value is DROP:
            del node[last]
        else:
            node[last] = value
    return yaml.safe_dump(data)


def sim(name: str, changes: dict, *expect: str, subprocess: bool = False):
    """A simulate row over ``trace.yaml`` = TRACE with ``changes``; the error names the file and ``expect``."""
    return bad(name, "simulate", ["trace.yaml"], "trace.yaml", *expect, files={"trace.yaml": trace_yaml(changes)},
               subprocess=subprocess)


LONG = [{"step": 0, "mean": 30000, "p95": 32000}]  # * 1.15 + 512 > qwen2.5-0.5b's 32,768 positions

ROWS = [
    # ------------------------------------------------------------------ python -m nereus_jax.plan
    bad("samples-per-prompt-0", "plan", ["--samples-per-prompt", "0"], "--samples-per-prompt", subprocess=True),
    bad("samples-per-prompt-1-grpo", "plan", ["--algorithm", "grpo", "--samples-per-prompt", "1"],
        "--samples-per-prompt >= 2"),
    bad("response-beyond-context", "plan", ["--model", "qwen2.5-0.5b", "--response-length", "40000"],
        "--response-length", "max_position_embeddings (32768)"),
    bad("gpus-not-int", "plan", ["--gpus", "abc"], "--gpus", subprocess=True),
    bad("gpus-0", "plan", ["--gpus", "0"], "--gpus"),
    bad("batch-0", "plan", ["--batch", "0"], "--batch"),
    bad("prompt-length-negative", "plan", ["--prompt-length", "-3"], "--prompt-length"),
    bad("unknown-hardware", "plan", ["--hardware", "h300"], "--hardware", "valid: h100"),
    bad("unknown-model", "plan", ["--model", "llama9"], "--model", "llama9"),
    bad("unknown-algorithm", "plan", ["--algorithm", "dpo"], "--algorithm", "dpo"),
    bad("headroom-1", "plan", ["--headroom", "1"], "--headroom"),
    bad("runners-up-negative", "plan", ["--runners-up", "-1"], "--runners-up"),
    bad("unknown-flag", "plan", ["--nodes", "8"], "--nodes"),
    # ------------------------------------------------------ python -m nereus_jax.simulate: the file
    bad("missing-file", "simulate", ["nope.yaml"], "nope.yaml"),
    bad("directory", "simulate", ["adir"], "adir", files={"adir": FOLDER}),
    bad("malformed-yaml", "simulate", ["t.yaml"], "t.yaml", "line 2", files={"t.yaml": "steps: [1, 2\n"},
        subprocess=True),
    bad("empty-yaml", "simulate", ["t.yaml"], "t.yaml", "mapping", files={"t.yaml": ""}),
    bad("list-yaml", "simulate", ["t.yaml"], "t.yaml", "mapping", files={"t.yaml": "- 1\n- 2\n"}),
    bad("binary-file", "simulate", ["t.yaml"], "t.yaml", files={"t.yaml": b"\x89PNG\r\n\x1a\n\xff\xfe\x00"},
        subprocess=True),
    # -------------------------------------------------------- python -m nereus_jax.simulate: its keys
    sim("steps-not-int", {"steps": "abc"}, "steps"),
    sim("steps-fraction", {"steps": 1.5}, "steps"),
    sim("steps-0", {"steps": 0}, "steps"),
    sim("seed-not-int", {"seed": "abc"}, "seed"),
    sim("no-hardware", {"hardware": DROP}, "hardware"),
    sim("unknown-hardware", {"hardware": "h300"}, "hardware", "valid: h100", subprocess=True),
    sim("unknown-model", {"models": "llama9"}, "models.", "llama9"),
    sim("unknown-role", {"models": {r: "qwen2.5-0.5b" for r in ("actor", "critc", "ref", "reward")}}, "critc"),
    sim("missing-role", {"models": {"actor": "qwen2.5-0.5b"}}, "models", "critic"),
    sim("model-not-a-name", {"models": ["qwen2.5-0.5b"]}, "models"),
    sim("unknown-algorithm", {"algorithm": "dpo"}, "algorithm", "dpo"),
    sim("prompts-0", {"workload.prompts_per_step": 0}, "workload.prompts_per_step"),
    sim("samples-0", {"workload.samples_per_prompt": 0}, "workload.samples_per_prompt"),
    sim("samples-1-grpo", {"algorithm": "grpo"}, "workload.samples_per_prompt"),
    sim("prompt-p95-below-mean", {"workload.prompt_length.p95": 100}, "workload.prompt_length"),
    sim("prompt-max-below-p95", {"workload.prompt_length.max": 200}, "workload.prompt_length"),
    sim("response-p95-below-mean", {"response_length.keyframes": [{"step": 0, "mean": 600, "p95": 500}]},
        "response_length.keyframes[0]"),
    sim("keyframe-without-p95", {"response_length.keyframes": [{"step": 0, "mean": 600}]},
        "response_length.keyframes[0]"),
    sim("response-beyond-context", {"response_length.keyframes": LONG}, "max_position_embeddings (32768)"),
    sim("max-over-p95-below-1", {"response_length.max_over_p95": 0.5}, "response_length.max_over_p95"),
    sim("pool-0", {"pool": [{"step": 0, "devices": 0}]}, "pool[0].devices"),
    sim("pool-row-without-devices", {"pool": [{"step": 0, "devices": 4}, {"step": 1}]}, "pool[1]"),
    sim("unknown-top-key", {"stpes": 3}, "stpes"),
    sim("unknown-section-key", {"controller.gamam": 1}, "gamam"),
    sim("section-not-a-mapping", {"controller": 5}, "controller"),
    sim("gamma-not-a-number", {"controller.gamma": "abc"}, "controller.gamma"),
    sim("headroom-2", {"planner": {"headroom": 2}}, "planner.headroom"),
    sim("slowdown-not-a-pair", {"truth": {"straggler_slowdown": 3}}, "truth.straggler_slowdown"),
    sim("unknown-policy-in-trace", {"policies": ["fixed", "nereus5"]}, "policies", "nereus5"),
    # ------------------------------------------------------- python -m nereus_jax.simulate: its flags
    bad("unknown-policy", "simulate", ["paper_drift", "--policies", "fixed,nerues"], "--policies", "nerues"),
    bad("no-policy", "simulate", ["paper_drift", "--policies", ","], "--policies"),
    bad("set-without-value", "simulate", ["paper_drift", "--set", "steps"], "--set"),
    bad("set-unknown-key", "simulate", ["paper_drift", "--set", "controller.gamam=1"], "controller.gamam"),
    bad("set-bad-yaml", "simulate", ["paper_drift", "--set", "steps=[1"], "--set", "steps=[1"),
    bad("set-bad-value", "simulate", ["paper_drift", "--set", "steps=abc"], "steps"),
    bad("sweep-without-values", "simulate", ["paper_drift", "--sweep", "controller.gamma"], "--sweep"),
    bad("sweep-bad-later-value", "simulate", ["paper_drift", "--sweep", "seed=1,x", "--json"], "seed"),
    bad("seed-not-int", "simulate", ["paper_drift", "--seed", "abc"], "--seed"),
    bad("plot-under-a-file", "simulate", ["paper_drift", "--plot", "f/x.png"], "--plot", files={"f": "x"}),
]


def test_the_tables_base_trace_is_valid(tmp_path):
    """So each simulate row fails for the one thing it changes."""
    (tmp_path / "trace.yaml").write_text(trace_yaml({}))
    assert load_trace(tmp_path / "trace.yaml").steps == 2


@pytest.mark.parametrize("row", ROWS)
def test_bad_input_exits_2_with_one_line_naming_it_and_writes_nothing(row: Bad, tmp_path, monkeypatch, capsys):
    for path, content in row.files:
        target = tmp_path / path
        if content is FOLDER:
            target.mkdir()
        elif isinstance(content, bytes):
            target.write_bytes(content)
        else:
            target.write_text(content)
    before = sorted(tmp_path.rglob("*"))
    monkeypatch.chdir(tmp_path)
    code, out, err = _subprocess(row, tmp_path) if row.subprocess else _in_process(row, capsys)
    assert "Traceback" not in out + err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert all(s in lines[0] for s in row.expect), (row.expect, lines[0])
    assert code == 2 and out == "", (code, out)
    assert sorted(tmp_path.rglob("*")) == before  # no run directory, plot or other output


def _in_process(row: Bad, capsys) -> tuple[int, str, str]:
    """main(argv) here; an exception other than SystemExit fails the test with its traceback."""
    main = importlib.import_module(f"nereus_jax.{row.cli}").main
    try:
        result = main(list(row.argv))
        code = result if isinstance(result, int) else 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 1
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _subprocess(row: Bad, cwd: Path) -> tuple[int, str, str]:
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))}
    done = subprocess.run([sys.executable, "-m", f"nereus_jax.{row.cli}", *row.argv], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    return done.returncode, done.stdout, done.stderr
