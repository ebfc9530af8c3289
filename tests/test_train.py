"""The entry point: `--check-sharding` (sharded forward and gradient vs one device), clean failures, --help.
The RL job itself is exercised end to end in tests/runtime/test_job.py."""

import json
import subprocess
import sys

import pytest

from nereus_jax.train import main


@pytest.mark.smoke
def test_sharding_check_matches_single_device_and_writes_summary(tmp_path):
    assert main(["--check-sharding", "--run-dir", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["ok"] and summary["devices"] == 8 and summary["dp"] == 8
    assert summary["max_logit_error"] < 1e-4 and summary["max_grad_error"] < 1e-4


def test_tp_above_kv_heads_with_pipeline_layout_trains_like_single_device(tmp_path):
    assert main(["plan.default.tp=4", "plan.default.pp=2", "--check-sharding", "--run-dir", str(tmp_path)]) == 0
    assert json.loads((tmp_path / "summary.json").read_text())["layout"] == "tp4xpp2"


def test_bad_override_exits_2_naming_the_key(tmp_path, capsys):
    assert main(["model.num_haeds=4", "--run-dir", str(tmp_path)]) == 2
    assert "model.num_heads" in capsys.readouterr().err


def test_indivisible_layout_exits_2_before_any_compute(tmp_path, capsys):
    assert main(["plan.default.tp=3", "--check-sharding", "--run-dir", str(tmp_path)]) == 2
    assert "num_kv_heads" in capsys.readouterr().err
    assert not (tmp_path / "summary.json").exists()


def test_help_lists_the_config_tree():
    out = subprocess.run([sys.executable, "-m", "nereus_jax.train", "--help"], capture_output=True, text=True,
                         check=True).stdout
    assert "model.num_heads" in out and "trainer.steps" in out
