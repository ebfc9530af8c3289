"""logging.wandb: the reporter logs each step's scalars (the ones TensorBoard gets) at their step, the config
and the summary to a W&B run and finishes it, on the primary process only. The wiring is checked against a
stand-in ``wandb`` module (always), the real package in offline mode by reading back the run file it writes
(skipped when wandb is not installed), and a missing package stops the job before any work with the fix."""

import dataclasses
import json
import os
import struct
import sys
import time
import types

import pytest
from google.protobuf.message import DecodeError

from nereus_jax.config import ConfigError, load_config
from nereus_jax.runtime import run as run_mod
from nereus_jax.runtime.report import RunReport
from nereus_jax.runtime.step.initial_plan import AUTO_MICRO_BATCH_TOKENS

CONFIG = {"algorithm": {"name": "grpo"}, "trainer": {"steps": 2}}
STEPS = [{"step": 0, "reward_mean": 0.25, "accuracy": 0.5, "kl": 0.0, "response_length_mean": 7, "ok": True,
          "plan_short": "colocated", "stage_seconds": {"actor-gen": 1.5, "actor-train": 2.25}},
         {"step": 1, "reward_mean": 0.375, "accuracy": 0.75, "kl": 0.0125, "response_length_mean": 6.5, "ok": False,
          "plan_short": "colocated", "stage_seconds": {"actor-gen": 1.25, "actor-train": 2.0}}]
LOGGED = [{"reward_mean": 0.25, "accuracy": 0.5, "kl": 0.0, "response_length_mean": 7, "ok": True,
           "stage_seconds/actor-gen": 1.5, "stage_seconds/actor-train": 2.25},
          {"reward_mean": 0.375, "accuracy": 0.75, "kl": 0.0125, "response_length_mean": 6.5, "ok": False,
           "stage_seconds/actor-gen": 1.25, "stage_seconds/actor-train": 2.0}]
SUMMARY = {"algorithm": "grpo", "accuracy_after": 0.75, "steps": 2, "accuracy_sft_control": None,
           "controller_events": [{"step": 1}], "plan": {"x": 1}}
SUMMARY_LOGGED = {"algorithm": "grpo", "accuracy_after": 0.75, "steps": 2}  # the scalars and strings


class _FakeRun:
    def __init__(self, calls):
        self.calls, self.summary = calls, {}

    def log(self, data, step=None):
        self.calls.append(("log", dict(data), step))

    def finish(self):
        self.calls.append(("finish", dict(self.summary)))


@pytest.fixture
def fake_wandb(monkeypatch):
    calls = []
    module = types.ModuleType("wandb")
    module.init = lambda **kwargs: calls.append(("init", kwargs)) or _FakeRun(calls)
    monkeypatch.setitem(sys.modules, "wandb", module)
    monkeypatch.delenv("WANDB_DIR", raising=False)
    return calls


def _run(report):
    for m in STEPS:
        report.step(m)
    report.finish(SUMMARY)


def test_the_reporter_logs_each_steps_scalars_at_its_step_then_the_summary_and_finishes(tmp_path, fake_wandb):
    run_dir = tmp_path / "run-7"
    _run(RunReport(str(run_dir), 2, progress=False, tensorboard=False,
                   wandb={"project": "p", "mode": "offline", "config": CONFIG}))
    assert fake_wandb == [
        ("init", {"project": "p", "mode": "offline", "config": CONFIG, "dir": str(run_dir), "name": "run-7"}),
        ("log", LOGGED[0], 0), ("log", LOGGED[1], 1), ("finish", SUMMARY_LOGGED)]


def test_only_the_primary_process_opens_a_run(tmp_path, fake_wandb):
    _run(RunReport(str(tmp_path / "run"), 2, progress=False, tensorboard=False, wandb={"project": "p"},
                   primary=False))
    assert fake_wandb == [] and not (tmp_path / "run").exists()


def test_wandb_dir_from_the_environment_wins_over_the_run_directory(tmp_path, fake_wandb, monkeypatch):
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb"))
    _run(RunReport(str(tmp_path / "run"), 2, progress=False, tensorboard=False, wandb={"project": "p"}))
    assert fake_wandb[0][1]["dir"] == str(tmp_path / "wandb")


def test_the_job_passes_the_logging_keys_and_the_whole_config(tmp_path, monkeypatch):
    got = {}

    class Stop(Exception):
        pass

    def capture(run_dir, total_steps, **kwargs):
        got.update(kwargs)
        raise Stop

    monkeypatch.setattr(run_mod, "RunReport", capture)
    cfg = load_config("grpo_tiny", ["logging.wandb=true", "logging.wandb_project=demo", "logging.wandb_mode=offline"])
    with pytest.raises(Stop):
        run_mod.run_job(cfg, str(tmp_path / "run"))
    # the config the job ran: trainer.micro_batch_tokens=null resolved to the budget the memory model chose
    ran = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, micro_batch_tokens=AUTO_MICRO_BATCH_TOKENS))
    assert cfg.trainer.micro_batch_tokens is None
    assert got["wandb"] == {"project": "demo", "mode": "offline", "config": ran.to_dict()}
    monkeypatch.setattr(run_mod, "RunReport", capture)
    with pytest.raises(Stop):
        run_mod.run_job(load_config("grpo_tiny"), str(tmp_path / "run"))
    assert got["wandb"] is None  # off by default


def test_missing_wandb_stops_before_the_run_directory_with_the_fix(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    with pytest.raises(ConfigError, match=r"pip install 'nereus-jax\[wandb\]', or set logging\.wandb=false"):
        RunReport(str(tmp_path / "run"), 1, progress=False, tensorboard=False, wandb={"project": "p"})
    assert not (tmp_path / "run").exists()
    report = RunReport(str(tmp_path / "run"), 1, progress=False, tensorboard=False)  # off: not needed
    report.step(STEPS[0])
    report.close()


def test_the_command_line_job_with_wandb_missing_exits_2_before_any_work(tmp_path, monkeypatch, capsys):
    from nereus_jax import train

    monkeypatch.setitem(sys.modules, "wandb", None)
    for name in ("JAX_PLATFORMS", "XLA_FLAGS"):  # train.main sets them for the CPU devices: undo afterwards
        monkeypatch.setenv(name, os.environ.get(name, ""))
    monkeypatch.setattr(run_mod, "check_inputs", lambda *a, **k: pytest.fail("the job started"))
    code = train.main(["grpo_tiny", "logging.wandb=true", "logging.progress=false", "--run-dir", str(tmp_path / "r")])
    assert code == 2
    assert "logging.wandb=true needs the wandb package" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


# ------------------------------------------------------------------------------------- the real package
def _records(path):
    """The protobuf records of a W&B run file (``run-<id>.wandb``): a 7-byte header, then LevelDB log
    blocks of 32 KiB holding records split into FULL/FIRST/MIDDLE/LAST chunks (7-byte chunk headers)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block = path.read_bytes(), 32768
    assert data[:7] == b":W&B" + struct.pack("<HB", 0xBEE1, 0), data[:7]
    i, pending = 7, b""
    while i + 7 <= len(data):
        if block - i % block < 7:  # a block's tail too short for a chunk header is padding
            i += block - i % block
            continue
        _, length, kind = struct.unpack_from("<IHB", data, i)
        if kind == 0:
            break
        pending += data[i + 7:i + 7 + length]
        i += 7 + length
        if kind in (1, 4):  # FULL or LAST: a whole record
            yield pb.Record.FromString(pending)
            pending = b""


def _finished_records(path, timeout=30.0):
    """The run file's records once wandb's service has written its last one, ``exit``: run.finish() returns
    before the service has written the file out."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            records = list(_records(path))
        except (DecodeError, struct.error):  # a record being written
            records = []
        if records and records[-1].WhichOneof("record_type") == "exit":
            return records
        assert time.monotonic() < deadline, f"{path} has no exit record after {timeout} s: {records[-3:]}"
        time.sleep(0.1)


def test_offline_wandb_run_file_holds_each_step_the_config_and_the_summary(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    for name, value in {"WANDB_DIR": tmp_path / "wandb", "WANDB_CONFIG_DIR": tmp_path / "config",
                        "WANDB_CACHE_DIR": tmp_path / "cache", "WANDB_DATA_DIR": tmp_path / "data",
                        "WANDB_MODE": "offline", "WANDB_SILENT": "true"}.items():
        monkeypatch.setenv(name, str(value))
    (tmp_path / "wandb").mkdir()
    _run(RunReport(str(tmp_path / "run"), 2, progress=False, tensorboard=False,
                   wandb={"project": "nereus_jax_test", "mode": "offline", "config": CONFIG}))
    (path,) = (tmp_path / "wandb").glob("wandb/offline-run-*/run-*.wandb")
    history, config, summary = {}, {}, {}
    for record in _finished_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            row = {item.nested_key[0] if item.nested_key else item.key: json.loads(item.value_json)
                   for item in record.history.item}
            history[row.pop("_step")] = {k: v for k, v in row.items() if not k.startswith("_")}
        elif kind in ("run", "config"):
            updates = record.run.config.update if kind == "run" else record.config.update
            config.update({u.key: json.loads(u.value_json) for u in updates if not u.key.startswith("_")})
        elif kind == "summary":
            summary.update({(u.nested_key[0] if u.nested_key else u.key): json.loads(u.value_json)
                            for u in record.summary.update})
    assert history == {0: LOGGED[0], 1: LOGGED[1]}
    assert config == CONFIG
    assert {k: summary.get(k) for k in SUMMARY_LOGGED} == SUMMARY_LOGGED
