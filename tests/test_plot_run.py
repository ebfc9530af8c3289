"""tools/plot_run.py: a PNG from a run's metrics.jsonl (+ summary.json), and clear exit-2 errors on bad input."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parent.parent / "tools" / "plot_run.py"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

_spec = importlib.util.spec_from_file_location("plot_run", TOOL)
plot_run = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plot_run)


def _step(step: int, **extra) -> dict:
    stages = {"actor-gen": 0.03 + 0.001 * step, "reward": 0.0003, "actor-infer": 0.01, "ref-infer": 0.01,
              "actor-train": 0.06, "weight-sync": 0.02}
    if step == 0:
        stages = {k: 20 * v for k, v in stages.items()}  # compilation
    return {"step": step, "reward_mean": 0.1 + 0.02 * step, "accuracy": 0.1 + 0.02 * step, "kl": 0.001 * step,
            "response_length_mean": 3.2 + 0.01 * step, "stage_seconds": stages, "loss": 0.01,
            "plan": "ExecutionPlan(...)", **extra}


def _write_run(run_dir: Path, records, summary=None) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    lines = [r if isinstance(r, str) else json.dumps(r) for r in records]
    (run_dir / "metrics.jsonl").write_text("".join(line + "\n" for line in lines))
    if summary is not None:
        (run_dir / "summary.json").write_text(summary if isinstance(summary, str) else json.dumps(summary))
    return run_dir


def _assert_png(path: Path):
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and len(data) > 10_000, (path, len(data))


def test_plot_with_summary_writes_png_in_run_dir(tmp_path):
    summary = {"algorithm": "grpo", "model": "tiny", "task": "addition", "accuracy_before": 0.2,
               "accuracy_after": 0.45, "accuracy_sft_control": 0.3, "steps": 8, "wall_s": 61.0}
    run = _write_run(tmp_path / "run", [_step(i) for i in range(8)], summary)
    out = plot_run.plot_run(str(run))
    assert Path(out) == run / "run.png"
    _assert_png(run / "run.png")


def test_plot_without_summary_with_varying_stages_and_out(tmp_path):
    records = [_step(0), _step(1), _step(2, stage_seconds={"actor-gen": 0.1, "transition": 0.5}),
               {k: v for k, v in _step(3).items() if k != "stage_seconds"}]
    run = _write_run(tmp_path / "run", records)
    (run / "metrics.jsonl").write_text((run / "metrics.jsonl").read_text() + "\n")  # a blank line is fine
    out = tmp_path / "plots" / "mine.png"
    assert plot_run.main([str(run), "--out", str(out)]) == 0
    _assert_png(out)
    assert not (run / "run.png").exists()
    assert list(plot_run.stage_series(records)) == ["actor-gen", "reward", "actor-infer", "ref-infer",
                                                    "actor-train", "weight-sync", "transition"]
    assert plot_run.stage_series(records)["transition"] == [0.0, 0.0, 0.5, 0.0]


def test_single_step_plots(tmp_path):
    run = _write_run(tmp_path / "run", [_step(0)])
    _assert_png(Path(plot_run.plot_run(str(run))))


@pytest.mark.parametrize("case, fragment", [
    ("no_dir", "does not exist"),
    ("no_file", "metrics.jsonl not found"),
    ("empty", "is empty"),
    ("blank_only", "is empty"),
    ("bad_json", "line 2: not valid JSON"),
    ("truncated", "line 3: not valid JSON"),
    ("not_object", "line 1: expected a JSON object"),
    ("missing_key", "line 2: missing kl"),
    ("not_number", "line 1: accuracy='high' is not a finite number"),
    ("bad_stages", "line 1: stage_seconds must map"),
    ("bad_summary", "summary.json: not valid JSON"),
])
def test_bad_input_exits_2_naming_file_and_fix(tmp_path, capsys, case, fragment):
    run = tmp_path / "run"
    good = json.dumps(_step(0))
    if case == "no_file":
        run.mkdir()
    elif case != "no_dir":
        metrics, summary = {
            "empty": ([], None),
            "blank_only": (["", "  "], None),
            "bad_json": ([good, "{'step': 1}"], None),
            "truncated": ([good, json.dumps(_step(1)), good[:30]], None),
            "not_object": (["[1, 2]"], None),
            "missing_key": ([good, json.dumps({k: v for k, v in _step(1).items() if k != "kl"})], None),
            "not_number": ([json.dumps(_step(0, accuracy="high"))], None),
            "bad_stages": ([json.dumps(_step(0, stage_seconds=[1, 2]))], None),
            "bad_summary": ([good], '{"accuracy_before": 0.1,'),
        }[case]
        _write_run(run, metrics, summary)
        if case == "empty":
            (run / "metrics.jsonl").write_text("")
    with pytest.raises(plot_run.PlotRunError, match=fragment):
        plot_run.plot_run(str(run))
    assert plot_run.main([str(run)]) == 2
    err = capsys.readouterr().err
    assert fragment in err and str(run) in err
    assert not (run / "run.png").exists()


def test_command_line_exit_codes(tmp_path):
    run = _write_run(tmp_path / "run", [_step(i) for i in range(3)])
    ok = subprocess.run([sys.executable, str(TOOL), str(run)], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.strip() == str(run / "run.png")
    _assert_png(run / "run.png")
    bad = subprocess.run([sys.executable, str(TOOL), str(tmp_path / "nope")], capture_output=True, text=True)
    assert bad.returncode == 2 and "does not exist" in bad.stderr and "--run-dir" in bad.stderr
