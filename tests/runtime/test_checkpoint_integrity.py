"""Checkpoints carry a checksum per array, verified on restore: a checkpoint whose bytes were changed is named
(with the array) and the resume falls back to the previous complete checkpoint with a warning, or stops with
``checkpoint.strict_resume=true``; a damaged checkpoint's error is one message, not asyncio noise."""

import os
from pathlib import Path

import numpy as np
import pytest

from nereus_jax.config import load_config
from nereus_jax.runtime.durability.checkpoint import DamagedCheckpoint, checksums, restore_job
from nereus_jax.runtime.run import check_inputs, run_job

pytestmark = pytest.mark.resume

BASE = ["trainer.warmup_sft_steps=0", "trainer.prompts_per_step=8", "task.eval_size=8", "cluster.schedule=[]",
        "rollout.samples_per_prompt=2", "logging.progress=false", "logging.tensorboard=false",
        "controller.enabled=false", "trainer.sft_control=false"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A run of 2 PPO steps with a checkpoint after each (steps 1 and 2)."""
    root = tmp_path_factory.mktemp("integrity")
    cfg = load_config("ppo_tiny", BASE + ["trainer.steps=2", "checkpoint.every_steps=1"])
    run_job(cfg, str(root / "run"))
    return root / "run" / "checkpoints"


def _flip(step_dir: Path, count: int = 64) -> Path:
    """XORs ``count`` bytes in the middle of the step's largest array data file (its size unchanged)."""
    files = [p for p in (step_dir / "state").rglob("*") if p.is_file()]
    target = max(files, key=lambda p: p.stat().st_size)
    data = bytearray(target.read_bytes())
    middle = len(data) // 2
    for i in range(middle, middle + count):
        data[i] ^= 0xA5
    target.write_bytes(bytes(data))
    return target


def _resume(ckpt, tmp_path, *extra):
    import shutil

    copy = tmp_path / "ckpt"
    shutil.copytree(ckpt, copy)
    cfg = load_config("ppo_tiny", BASE + ["trainer.steps=2", *extra])
    return cfg, copy


def test_checksums_differ_for_a_single_flipped_bit_and_agree_on_device_and_host():
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal((7, 5)).astype(np.float32), np.arange(12, dtype=np.int32),
              rng.standard_normal(9).astype(jnp.bfloat16)]
    host = checksums(arrays)
    assert host == checksums([jnp.asarray(a) for a in arrays])
    for k, a in enumerate(arrays):
        for position in (0, a.size // 2, a.size - 1):
            flipped = a.copy().reshape(-1)
            raw = flipped.view({4: np.uint32, 2: np.uint16}[a.dtype.itemsize])
            raw[position] ^= 1
            assert checksums([flipped.reshape(a.shape)])[0] != host[k]


def test_a_resume_from_a_corrupted_checkpoint_falls_back_to_the_one_before_with_a_warning(saved, tmp_path):
    cfg, ckpt = _resume(saved, tmp_path)
    _flip(ckpt / "2")
    inputs = check_inputs(cfg)
    messages = []
    try:
        job, meta = restore_job(cfg, inputs.task, inputs.tokenizer, str(ckpt), rewarder=inputs.rewarder,
                                log=messages.append)
        job.close()
    finally:
        inputs.rewarder.close()
    assert meta["step"] == 1
    assert len(messages) == 1 and "warning" in messages[0] and f"{ckpt / '2'}" in messages[0]


def test_strict_resume_stops_naming_the_checkpoint(saved, tmp_path):
    cfg, ckpt = _resume(saved, tmp_path, "checkpoint.strict_resume=true")
    _flip(ckpt / "2")
    inputs = check_inputs(cfg)
    try:
        with pytest.raises(DamagedCheckpoint, match=str(ckpt / "2")) as error:
            restore_job(cfg, inputs.task, inputs.tokenizer, str(ckpt), rewarder=inputs.rewarder)
    finally:
        inputs.rewarder.close()
    print(error.value)


def test_the_train_cli_reports_a_damaged_checkpoint_in_one_line(saved, tmp_path):
    import subprocess
    import sys

    _, ckpt = _resume(saved, tmp_path)
    _flip(ckpt / "2")
    _flip(ckpt / "1")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-m", "nereus_jax.train", "ppo_tiny", *BASE, "trainer.steps=3",
                          f"checkpoint.resume_from={ckpt}", "--run-dir", str(tmp_path / "run")],
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 2, out.stderr[-2000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and str(ckpt / "1") in errors[0], out.stderr[-2000:]
    assert "Traceback" not in out.stderr and "Event loop is closed" not in out.stderr, out.stderr[-3000:]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_layout_independent_form_a_checkpoint_stores_keeps_every_bit(devices, dtype):
    """canonical_leaves (what a save writes) of a layout that stores kv heads twice keeps -0.0, subnormals and
    NaN payloads; _units (what a restore lays out) puts them back bit for bit."""
    import jax

    from nereus_jax.config import ModelConfig
    from nereus_jax.elastic.emu import EMU
    from nereus_jax.elastic.spec import StateSpec
    from nereus_jax.model_stage import ModelStage
    from nereus_jax.models import init_params
    from nereus_jax.runtime.durability.checkpoint import canonical_leaves
    from nereus_jax.sharding import Layout

    cfg = ModelConfig(num_heads=4, num_kv_heads=2)
    spec = StateSpec(cfg, "infer", dtype=dtype)
    width = np.uint16 if dtype == "bfloat16" else np.uint32
    specials = np.asarray([0x8000, 0x0001, 0x7FC1, 0xFFA5, 0x7F81] if dtype == "bfloat16" else
                          [0x80000000, 0x00000001, 0x7FC00123, 0xFFA00005, 0x7F800001], width)

    def poison(x):
        x = np.array(np.asarray(x, spec.dtype))
        flat = x.reshape(-1).view(width)
        flat[: specials.size] = specials[: flat.size]
        return x

    params = jax.tree.map(poison, init_params(cfg, seed=0))
    unit = EMU.create(ModelStage("ref", "infer"), spec, Layout(tp=4), devices[:4], {"params": params})
    saved = [np.asarray(x) for x in canonical_leaves(unit)]
    for got, want in zip(saved, jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(got.view(width), np.asarray(want).view(width))
