"""The reporter's TensorBoard events hold each step's scalars, read back by a reader that shares nothing with the
writer: TensorBoard's own EventAccumulator when ``tensorboard`` is installed, and always the TFRecord reader of
_tb_events.py (CRC-32C per RFC 3720, written out there) that decodes the ``Event`` protobufs."""

import sys
import time

import numpy as np
import pytest
from _tb_events import crc32c, read_scalars, read_scalars_so_far

from nereus_jax.config import ConfigError
from nereus_jax.runtime.report import TB_FLUSH_SECS, RunReport


def _metrics(step, reward, kl, gen_s, train_s):
    return {"step": step, "reward_mean": reward, "accuracy": 0.5, "kl": kl, "response_length_mean": 7,
            "over_memory_cap": False, "plan_short": "colocated", "stage_seconds": {"actor-gen": gen_s,
                                                                                   "actor-train": train_s}}


STEPS = [_metrics(0, 0.1, 0.0, 1.5, 2.25), _metrics(1, 0.35, 0.0123, 1.25, 2.0)]
# (tag, step) -> value as TensorBoard stores it (float32); the numbers but `step`, nested stage seconds flattened
EXPECTED = {(tag, m["step"]): float(np.float32(v)) for m in STEPS for tag, v in [
    ("reward_mean", m["reward_mean"]), ("accuracy", 0.5), ("kl", m["kl"]), ("response_length_mean", 7),
    ("over_memory_cap", 0), ("stage_seconds/actor-gen", m["stage_seconds"]["actor-gen"]),
    ("stage_seconds/actor-train", m["stage_seconds"]["actor-train"])]}


def test_crc32c_reference_matches_the_standard_check_value():
    assert crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value of RFC 3720


def test_a_step_reaches_the_disk_while_the_run_goes_on_and_the_file_holds_exactly_the_scalars(tmp_path):
    report = RunReport(str(tmp_path / "run"), len(STEPS), progress=False)
    report.step(STEPS[0])
    logdir, first = tmp_path / "run" / "tensorboard", {k: v for k, v in EXPECTED.items() if k[1] == 0}
    deadline = time.monotonic() + TB_FLUSH_SECS + 10  # a live TensorBoard sees the step before close()
    while read_scalars_so_far(logdir) != first and time.monotonic() < deadline:
        time.sleep(0.1)
    assert read_scalars(logdir) == first
    report.step(STEPS[1])
    report.close()
    assert read_scalars(logdir) == EXPECTED


def test_tensorboard_reads_the_same_scalars(tmp_path):
    ea = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    report = RunReport(str(tmp_path / "run"), len(STEPS), progress=False)
    for m in STEPS:
        report.step(m)
    report.close()
    acc = ea.EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    acc.Reload()
    read = {(tag, e.step): e.value for tag in acc.Tags()["scalars"] for e in acc.Scalars(tag)}
    assert read == EXPECTED


def test_missing_tensorboardx_stops_before_the_run_directory_with_the_fix(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # `import tensorboardX` raises ImportError
    with pytest.raises(ConfigError, match=r"pip install tensorboardX, or set logging\.tensorboard=false"):
        RunReport(str(tmp_path / "run"), 1, progress=False, tensorboard=True)
    assert not (tmp_path / "run").exists()
    report = RunReport(str(tmp_path / "run"), 1, progress=False, tensorboard=False)  # off: not needed
    report.step(STEPS[0])
    report.close()
    assert not (tmp_path / "run" / "tensorboard").exists()
    assert (tmp_path / "run" / "metrics.jsonl").read_text().count("\n") == 1
