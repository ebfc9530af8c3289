"""RUN_DIR/calibration.json: a calibrated CostModel written atomically and read back exactly."""

import json
import os
import re

import pytest

from nereus_jax.elastic.costs.calibration_file import (
    CalibrationError,
    load_calibration,
    read_calibration,
    save_calibration,
)
from nereus_jax.elastic.costs.model import CostModel

# Values a fit could leave (no short decimal form), so a lossy float format would show.
EFFICIENCY = {"gemm": 0.1234567890123456, "attention": 1 / 3, "memory": 0.7071067811865476,
              "collective_intra": 2 / 7, "collective_inter": 0.05, "host": 0.9, "overhead": 1.0}
HALF_SIZES = {"gemm_rows": 37.123456789, "gemm_width": 1e-7, "attention_keys": 311.0}


def test_round_trip_gives_the_cost_model_exactly(tmp_path):
    cm = CostModel("h100", EFFICIENCY, HALF_SIZES)
    path = save_calibration(tmp_path, cm, steps=12, model="tiny")
    assert path == str(tmp_path / "calibration.json")
    data = json.loads((tmp_path / "calibration.json").read_text())
    assert data == {"format": 1, "hardware": "h100", "efficiency": cm.efficiency, "half_sizes": cm.half_sizes,
                    "steps": 12, "model": "tiny"}
    for where in (tmp_path, path):  # the run directory or the file itself
        loaded = load_calibration(where)
        assert loaded.hardware.name == "h100"
        assert loaded.efficiency == cm.efficiency and loaded.half_sizes == cm.half_sizes
    assert read_calibration(tmp_path)["steps"] == 12


def test_a_write_replaces_the_file_whole_and_leaves_no_temporary(tmp_path):
    save_calibration(tmp_path, CostModel("cpu"))
    save_calibration(tmp_path, CostModel("cpu", EFFICIENCY), steps=3)
    assert os.listdir(tmp_path) == ["calibration.json"]
    assert load_calibration(tmp_path).efficiency == EFFICIENCY


def test_a_failed_write_keeps_the_previous_file(tmp_path):
    save_calibration(tmp_path, CostModel("cpu", EFFICIENCY))
    with pytest.raises(TypeError):  # not JSON: fails while the temporary file is being written
        save_calibration(tmp_path, CostModel("cpu"), steps=object())
    assert os.listdir(tmp_path) == ["calibration.json"]
    assert load_calibration(tmp_path).efficiency == EFFICIENCY


def test_meta_cannot_overwrite_the_calibration(tmp_path):
    with pytest.raises(ValueError, match="hardware"):
        save_calibration(tmp_path, CostModel("cpu"), hardware="h100")


@pytest.mark.parametrize("content, needle", [
    ('{"format": 1, "hardware": "cpu", "efficiency": {"gemm": 0.5, "tensor_cores": 0.9}}', "tensor_cores"),
    ('{"format": 1, "hardware": "cpu", "efficiency": {"gemm": -1}}', "efficiency.gemm"),
    ('{"format": 1, "hardware": "cpu", "efficiency": {}, "half_sizes": {"gemm_rows": NaN}}', "half_sizes.gemm_rows"),
    ('{"format": 1, "hardware": "tpu9", "efficiency": {}}', "unknown hardware 'tpu9'"),
    ('[1, 2]', "expected a JSON object"),
])
def test_bad_contents_name_the_file_and_the_problem(tmp_path, content, needle):
    (tmp_path / "calibration.json").write_text(content)
    with pytest.raises(CalibrationError, match=re.escape(str(tmp_path))) as error:
        load_calibration(tmp_path)
    assert needle in str(error.value)
