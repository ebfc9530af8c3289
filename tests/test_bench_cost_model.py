"""tools/bench_cost_model.py's layouts and error summaries: ``TPxDP[xPP[xEP]]`` parsed as the runtime builds them
(reference: ``sharding.layout.check_layout``, what the job refuses), one clear error per layout it cannot build,
the ``--moe`` default calibrating on an ep > 1 layout and holding out other ep > 1 ones, and the held-out MAPE
recomputed by hand. The measured run itself is a figure (docs/results.md), not a test: see the long test."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from nereus_jax.elastic.costs import StageChoice
from nereus_jax.sharding import Layout
from nereus_jax.sharding.layout import check_layout

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_cost_model", ROOT / "tools" / "bench_cost_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_layouts_parse_with_missing_degrees_one(bench):
    assert bench.parse_layouts("1x8,2x2x2,1x4x1x2", bench.BENCH_MOE) == [(1, 8, 1, 1), (2, 2, 2, 1), (1, 4, 1, 2)]
    assert bench.layout_key(2, 2, 1, 2) == "tp2xdp2xep2" and bench.layout_key(1, 2, 4, 1) == "tp1xdp2xpp4"


@pytest.mark.parametrize("spec, fix", [("1x2x1x2", "pass --moe"), ("1x1x1x3", "divide the model's 8 experts"),
                                       ("1x1x2x2", "pp = 1"), ("2x2x1x4", "16 exceeds the 8"),
                                       ("1x", "TPxDPxPPxEP"), ("1x1x1x1x1", "TPxDPxPPxEP"), ("0x1", ">= 1")])
def test_a_layout_it_cannot_build_names_the_fix(bench, spec, fix):
    cfg = bench.BENCH_MODEL if fix == "pass --moe" else bench.BENCH_MOE
    with pytest.raises(ValueError, match=fix.replace("*", r"\*")):
        bench.parse_layouts(spec, cfg)


def test_moe_defaults_are_layouts_the_runtime_builds_and_hold_out_other_ep_layouts(bench):
    layouts = bench.parse_layouts(bench.MOE_LAYOUTS, bench.BENCH_MOE)
    for tp, _, pp, ep in layouts:
        check_layout(bench.BENCH_MOE, Layout(tp, pp, ep))  # raises on what the job refuses
    args = bench._parse(["--moe"])
    calib, held = layouts[: args.calibrate], layouts[args.calibrate:]
    assert args.layouts == layouts and args.reps == 1
    assert any(ep > 1 for *_, ep in calib)
    held_ep = [lay for lay in held if lay[3] > 1]
    assert len(held_ep) >= 3 and not set(held_ep) & set(calib)
    assert {ep for *_, ep in layouts} == {1, 2, 4, 8} and {tp for tp, *_ in layouts} == {1, 2}


def test_calibrate_must_leave_held_out_layouts(bench, capsys):
    with pytest.raises(SystemExit):
        bench._parse(["--moe", "--layouts", "1x8,1x4x1x2", "--calibrate", "2"])
    assert "--calibrate=2 must be in 1..1" in capsys.readouterr().err


def test_ep_mape_is_the_mean_over_held_out_ep_rows(bench):
    choices = {"a": StageChoice(1, 1, 8, 2), "b": StageChoice(1, 1, 4, 4, ep=2), "c": StageChoice(2, 1, 1, 8, ep=4),
               "d": StageChoice(2, 1, 4, 2)}
    rows = [{"layout": k, "stage": s, "measured_s": m, "predicted_s": p, "calibrated": k in "ab"}
            for k, s, m, p in [("a", "x", 1.0, 9.0), ("b", "x", 2.0, 1.0), ("c", "x", 2.0, 2.5), ("c", "y", 4.0, 3.0),
                               ("d", "x", 1.0, 1.5)]]
    assert bench._mape(rows, choices, lambda c: c.ep > 1) == {"x": 0.25, "y": 0.25}
    assert bench._mape(rows, choices, lambda c: True) == {"x": 0.375, "y": 0.25}


@pytest.mark.long  # ~1-2 min of compiling and timing MoE train steps; the fast tests above cover its parsing
def test_moe_calibration_runs_and_reports_the_ep_mape():
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_cost_model.py"), "--moe", "--layouts",
                          "1x4x1x2,1x2x1x4", "--calibrate", "1", "--rounds", "1"], capture_output=True, text=True,
                         check=True, cwd=ROOT, timeout=900)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["layouts_measured"] == ["tp1xdp4xep2", "tp1xdp2xep4"]
    assert result["ep_mape_by_stage"] == result["mape_by_stage"] and result["ep_mape"] == result["mape"]
    assert 0 < result["expert_load"] <= 1 / 2 and all(r["measured_s"] > 0 for r in result["rows"])
