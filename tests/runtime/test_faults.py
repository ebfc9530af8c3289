"""The job survives stops and faults: SIGTERM finishes the step, saves and exits 0 naming the resume
command; kill -9 during an asynchronous save leaves the previous checkpoint as the one resumed; a device
lost during a step is survived from the surviving units when a full copy of every state is left, else from
the last checkpoint, and the two recoveries continue identically.

Subprocesses get 8 CPU devices, a hard timeout, and SIGKILL when they hang (JAX traps SIGTERM); they
run last and share the module's persistent compilation cache, so they mostly reuse its programs.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from jobs import TINY_JOB

from nereus_jax.config import load_config
from nereus_jax.elastic.costs.calibration_file import read_calibration
from nereus_jax.elastic.emu import stage_checksum
from nereus_jax.model_stage import ACTOR_TRAIN, CRITIC_TRAIN
from nereus_jax.rl.tasks import make_task
from nereus_jax.rl.tokenizer import CharTokenizer
from nereus_jax.runtime.control.recovery import recover, training_snapshot
from nereus_jax.runtime.durability.checkpoint import Checkpointer, DeviceLost, read_metadata, restore_job
from nereus_jax.runtime.step.job import Job

pytestmark = pytest.mark.fault

ROOT = Path(__file__).resolve().parents[2]
BASE = TINY_JOB
KEYS = ("reward_mean", "kl", "loss", "policy_loss", "value_loss", "response_length_mean", "policy_version")


@pytest.fixture(scope="module")
def jax_cache() -> str:
    """The session's persistent compilation cache (tests/conftest.py), handed to subprocesses."""
    return os.environ["JAX_COMPILATION_CACHE_DIR"]


def _env(jax_cache: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    flags = "--xla_force_host_platform_device_count=8 " + os.environ.get("NEREUS_TEST_XLA_FLAGS", "")
    return {**env, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu",
            "JAX_COMPILATION_CACHE_DIR": jax_cache, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "PYTHONPATH": str(ROOT)}


def _wait(proc: subprocess.Popen, timeout: float) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()  # SIGKILL: JAX installs a SIGTERM handler
        out, err = proc.communicate()
        pytest.fail(f"subprocess hung for {timeout} s and was killed; stderr tail:\n{err[-3000:]}")
    return proc.returncode, out, err


# -------------------------------------------------------------------------------------- device loss
def _lose_during_step(tmp_path, warm, lost, where, *extra):
    """Steps 0, 1 (checkpointed after each), then ``lost`` devices fail in step 2 at ``where``; recovers
    and runs steps up to 3. Returns (recovery, results of the recovered steps, the job that failed)."""
    cfg = load_config(None, BASE + list(extra))
    job = Job(cfg, make_task(cfg.task), CharTokenizer(), actor=warm)
    ckpt = Checkpointer(str(tmp_path / "ckpt"), every_steps=1, keep=2)
    for s in range(2):
        job.step(s)
        ckpt.maybe_save(job, s + 1)
    ckpt.wait()
    before = training_snapshot(job)
    _inject(job, lost, where)
    with pytest.raises(DeviceLost) as failure:
        job.step(2)
    vars(job.learner).pop("rewards", None), vars(job.learner).pop("train_stage", None)  # the injection is over
    rec = recover(job, failure.value.device_ids, 2, before, ckpt.directory)
    ckpt.close()
    assert rec.plan == job.plan  # recovered in place: the job that failed runs on
    return rec, [job.step(s) for s in range(rec.next_step, 4)], job


def _inject(job, lost, where):
    if where == "reward":  # after generation, before any state changes
        def fail(*a, **k):
            raise DeviceLost(lost)

        job.learner.rewards = fail
    else:  # after actor-train stepped, while the critic trains
        original = job.learner.train_stage

        def train_stage(ms, data):
            if ms == CRITIC_TRAIN:
                raise DeviceLost(lost)
            return original(ms, data)

        job.learner.train_stage = train_stage


WHOLE = "plan.shard_optimizer=false"  # each training replica holds the whole optimizer state, not a block of it


@pytest.fixture(scope="module")
def from_checkpoint(warm, tmp_path_factory, jax_cache):
    """Devices 0 and 1 hold every actor-gen replica: losing them leaves no copy, so the checkpoint is used."""
    return _lose_during_step(tmp_path_factory.mktemp("loss"), warm, (0, 1), "reward", WHOLE)


def test_device_loss_without_a_surviving_copy_restores_the_last_checkpoint(from_checkpoint):
    rec, results, job = from_checkpoint
    assert rec.how == "checkpoint" and rec.next_step == 2 and "actor-gen" in rec.reason
    assert rec.checkpoint.endswith("/2") and "checkpoint" in rec.describe()
    assert not {0, 1} & set(job.plan.devices) and len(job.plan.devices) == 4
    assert [r.metrics["step"] for r in results] == [2, 3]


def test_device_loss_with_a_full_copy_left_replans_from_the_survivors(tmp_path, warm, from_checkpoint):
    """Losing devices 6 and 7 before any update of step 2 leaves a complete replica of every model-stage
    (each training replica holds the whole optimizer state: plan.shard_optimizer=false); the job continues on
    4 surviving devices without a checkpoint, bit for bit as the restored one does (same layouts, same state)."""
    rec, results, failed = _lose_during_step(tmp_path, warm, (6, 7), "reward", WHOLE)
    assert rec.how == "survivors" and rec.next_step == 2 and rec.checkpoint is None
    assert rec.moved is not None and failed.plan.devices == (0, 1, 2, 3)  # moved by a transition
    _, restored, _ = from_checkpoint
    for a, b in zip(results, restored, strict=True):
        np.testing.assert_array_equal(a.batch.response_br, b.batch.response_br)
        assert {k: a.metrics[k] for k in KEYS} == {k: b.metrics[k] for k in KEYS}
    for ms in (ACTOR_TRAIN, CRITIC_TRAIN):
        assert stage_checksum(failed.units[ms]).tolist() == stage_checksum(from_checkpoint[2].units[ms]).tolist()


def test_device_loss_with_the_optimizer_split_over_replicas_restores_the_checkpoint(tmp_path, warm):
    """With plan.shard_optimizer (the default) each training replica holds its own block of the optimizer
    state: losing devices 6 and 7 loses two blocks, so the loss that leaves a complete copy with whole copies
    restores the checkpoint instead, into replicas that again hold a block each, and the job goes on."""
    rec, results, job = _lose_during_step(tmp_path, warm, (6, 7), "reward")
    assert rec.how == "checkpoint" and rec.next_step == 2 and "optimizer state" in rec.reason, rec.reason
    assert rec.checkpoint.endswith("/2") and not {6, 7} & set(job.plan.devices)
    assert job.units[ACTOR_TRAIN][0].spec.shards == job.plan[ACTOR_TRAIN].dp > 1
    assert [r.metrics["step"] for r in results] == [2, 3] and all(np.isfinite(r.metrics["loss"]) for r in results)


def test_device_loss_after_a_partial_update_restores_the_checkpoint(tmp_path, warm, from_checkpoint):
    """actor-train has stepped but critic-train has not: the survivors are not one consistent state."""
    rec, results, _ = _lose_during_step(tmp_path, warm, (6, 7), "critic", WHOLE)
    assert rec.how == "checkpoint" and rec.next_step == 2 and "actor-train" in rec.reason
    _, restored, _ = from_checkpoint
    for a, b in zip(results, restored, strict=True):
        assert {k: a.metrics[k] for k in KEYS} == {k: b.metrics[k] for k in KEYS}


def _logged(run_dir) -> list[dict]:
    return [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """run_job, 4 steps, in this process (the controller is off: its timing-driven choices differ between
    any two runs). Returns (the args, its logged metrics)."""
    from nereus_jax.runtime.run import run_job

    tmp = tmp_path_factory.mktemp("straight")
    args = BASE + ["trainer.steps=4", "trainer.warmup_sft_steps=150", "trainer.sft_control=false",
                   "controller.enabled=false", f"logging.cache_dir={tmp / 'warm-cache'}"]
    summary = run_job(load_config(None, args), str(tmp / "a"))
    assert "stopped_by" not in summary
    return args, _logged(tmp / "a")


# the checkpoint case is left to -m long for CI time: test_device_loss_without_a_surviving_copy_restores_the_last_
# checkpoint covers the restore path, this one the same path through run_job
@pytest.mark.parametrize("fail, how", [((6, 7), "the surviving units"),
                                       pytest.param((0, 1), "checkpoint", marks=pytest.mark.long)])
def test_run_job_survives_devices_failing_mid_step(tmp_path, straight, monkeypatch, fail, how):
    """run_job with ``cluster.schedule`` failing devices during step 2 (after its generation): losing 6 and
    7 leaves a replica of every model-stage, so the job moves onto the survivors; losing 0 and 1 takes
    every actor-gen replica, so it restores the checkpoint written after step 1. Either way steps 2 and 3
    are logged once each, on 4 devices without the failed ones, and match the straight 8-device run up to
    the reduction order (dp 4 vs 8: the cross-plan bound of test_checkpoint.py)."""
    import re

    from nereus_jax.runtime import report as report_mod
    from nereus_jax.runtime.run import run_job

    args, want = straight
    lines: list[str] = []
    log = report_mod.RunReport.log
    monkeypatch.setattr(report_mod.RunReport, "log", lambda self, m: (lines.append(m), log(self, m))[-1])
    args = args + [f"cluster.schedule=[{{step: 2, fail: [{fail[0]}, {fail[1]}]}}]", "checkpoint.every_steps=1"]
    if how == "the surviving units":  # each training replica holds the whole optimizer state, not a block of it
        args.append("plan.shard_optimizer=false")
    summary = run_job(load_config(None, args), str(tmp_path / "run"))
    got = _logged(tmp_path / "run")
    assert [m["step"] for m in got] == [0, 1, 2, 3]
    assert any(f"recovered from {how}" in m for m in lines), lines
    used = {int(d) for group in re.findall(r"\[([\d, ]+)\]", summary["plan"]) for d in group.split(",")}
    assert len(used) == 4 and not used & set(fail), summary["plan"]
    for a, b in zip(want, got, strict=True):
        for k in KEYS:
            np.testing.assert_allclose(b[k], a[k], rtol=1e-4, atol=1e-6, err_msg=f"step {a['step']} {k}")


# ------------------------------------------------------------------------------------------ SIGTERM
def test_run_stopped_by_sigterm_and_resumed_logs_the_metrics_of_the_straight_run(tmp_path, straight, sigterm_after):
    """run_job end to end, in this process: the straight 4 steps vs SIGTERM during step 1 (the step
    finishes and is saved), then the same run with checkpoint.resume_from. The resumed run logs steps 2
    and 3 exactly as the straight run does (same plan)."""
    from nereus_jax.runtime.run import run_job

    args, a = straight
    disarm = sigterm_after(1)
    ckdir = tmp_path / "b" / "checkpoints"
    stopped = run_job(load_config(None, args), str(tmp_path / "b"))
    assert stopped["stopped_by"] == "SIGTERM" and stopped["resume_step"] == 2
    assert stopped["resume_from"] == str(ckdir) and read_metadata(str(ckdir))["step"] == 2
    assert read_calibration(tmp_path / "b")["steps"] == 2  # written with the summary of a stopped run too
    disarm()
    resumed = run_job(load_config(None, args + [f"checkpoint.resume_from={ckdir}"]), str(tmp_path / "b"))
    assert "stopped_by" not in resumed
    assert read_calibration(tmp_path / "b")["steps"] == 4

    b = _logged(tmp_path / "b")
    assert [m["step"] for m in b] == [0, 1, 2, 3]
    for ma, mb in zip(a, b, strict=True):
        assert {k: ma[k] for k in KEYS} == {k: mb[k] for k in KEYS}, ma["step"]



def _train(args, jax_cache, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "nereus_jax.train", "default", *BASE, *args], cwd=ROOT,
                            env=_env(jax_cache), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def test_sigterm_finishes_the_step_saves_and_exits_0_naming_the_resume_command(tmp_path, jax_cache):
    ckdir, run_dir = tmp_path / "ckpt", tmp_path / "run"
    args = ["trainer.steps=200", "logging.tensorboard=false", f"checkpoint.dir={ckdir}", "--run-dir", str(run_dir)]
    proc = _train(args, jax_cache)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not (metrics.exists() and metrics.read_text().count("\n") >= 1):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the run ended or hung before its first step: {proc.communicate()[1][-3000:]}")
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    rc, out, err = _wait(proc, 120)
    assert rc == 0, err[-3000:]
    done = [json.loads(x)["step"] for x in metrics.read_text().splitlines()]
    assert done == list(range(len(done))) and len(done) < 200
    meta = read_metadata(str(ckdir))
    assert meta["step"] == len(done)  # the step in flight finished and was saved
    assert f"checkpoint.resume_from={ckdir}" in err and "SIGTERM" in err
    # the named command resumes at the next step
    proc = _train([f"trainer.steps={len(done) + 1}", "logging.tensorboard=false", f"checkpoint.dir={ckdir}",
                   f"checkpoint.resume_from={ckdir}", "--run-dir", str(run_dir)], jax_cache)
    rc, out, err = _wait(proc, 240)
    assert rc == 0, err[-3000:]
    assert [json.loads(x)["step"] for x in metrics.read_text().splitlines()] == done + [len(done)]


# ------------------------------------------------------------------------------- kill -9 mid-save
CHILD = textwrap.dedent("""
    import os, signal, sys
    import jax, numpy as np
    jax.config.update("jax_default_matmul_precision", "highest")
    from nereus_jax.config import load_config
    from nereus_jax.rl.tasks import make_task
    from nereus_jax.rl.tokenizer import CharTokenizer
    from nereus_jax.runtime.durability.checkpoint import Checkpointer
    from nereus_jax.runtime.step.job import Job
    ckdir, base = sys.argv[1], sys.argv[2:]
    cfg = load_config(None, base)
    job = Job(cfg, make_task(cfg.task), CharTokenizer())
    ckpt = Checkpointer(ckdir, every_steps=1, keep=3)
    for s in range(10):
        job.step(s)
        if s == 0:
            ckpt.save(job, 1, wait=True)
            np.savez(os.path.join(ckdir, "..", "step1.npz"), *jax.tree.leaves(job.actor_host_params()))
            continue
        ckpt.save(job, s + 1)  # returns once the arrays are off the devices; files are written behind
        if not os.path.exists(os.path.join(ckdir, str(s + 1))):
            print("KILLED_DURING_SAVE", s + 1, sorted(os.listdir(ckdir)), flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        ckpt.wait()  # too late to catch it unfinished: wait, then try again on the next step
""")


def test_kill_9_during_an_async_save_resumes_from_the_previous_complete_checkpoint(tmp_path, jax_cache):
    ckdir = tmp_path / "ckpt"
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(ckdir), *BASE],
                            cwd=ROOT, env=_env(jax_cache), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    rc, out, err = _wait(proc, 240)
    assert rc == -signal.SIGKILL, err[-3000:]
    killed_at = int(out.split("KILLED_DURING_SAVE")[1].split()[0])
    assert not (ckdir / str(killed_at)).exists()
    assert any(".orbax-checkpoint-tmp" in n for n in os.listdir(ckdir))  # the unfinished save
    cfg = load_config(None, BASE)
    job, meta = restore_job(cfg, make_task(cfg.task), CharTokenizer(), str(ckdir))
    assert meta["step"] == killed_at - 1
    if killed_at == 2:  # the child dumped the actor after step 1
        want = np.load(tmp_path / "step1.npz")
        for i, x in enumerate(jax.tree.leaves(job.actor_host_params())):
            np.testing.assert_array_equal(x, want[f"arr_{i}"])
    assert job.step(meta["step"]).metrics["policy_version"] == meta["step"] + 1
