"""Post-training a local Hugging Face checkpoint end to end: ``model.hf_path`` gives the architecture, the
weights of every stage, the tokenizer and the chat template; chat prompts come from a JSONL file and are
scored by the math reward; the tuned actor leaves the run as a Hugging Face checkpoint (RUN_DIR/hf, with
every checkpoint under checkpoint.export_hf, and through ``python -m nereus_jax.export``)."""

import json

import jax
import numpy as np
import pytest
from hf_checkpoints import model_config, write_checkpoint, write_prompts

from nereus_jax.config import load_config
from nereus_jax.export import main as export_main
from nereus_jax.models import load_hf
from nereus_jax.runtime.run import run_job

pytestmark = pytest.mark.slow

GRPO = ["algorithm.name=grpo", "algorithm.kl_estimator=k3", "algorithm.kl_in_reward=false",
        "rollout.samples_per_prompt=2", "rollout.max_prompt_length=24", "rollout.max_response_length=8",
        "trainer.prompts_per_step=8", "trainer.actor_lr=1e-3", "plan.stages.actor-gen.dp=2",
        "task.name=file", "task.reward=math", "task.eval_size=8", "logging.progress=false",
        "logging.tensorboard=false", "controller.enabled=false"]


def _config(tmp_path, family, *extra):
    ckpt = write_checkpoint(tmp_path / "ckpt", family, seed=1)
    prompts = write_prompts(tmp_path / "prompts.jsonl", 40)
    return load_config(None, GRPO + [f"model.hf_path={ckpt}", f"task.prompt_file={prompts}", *extra]), ckpt


def _tree_equal(a, b):
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


def test_a_run_from_a_checkpoint_trains_it_and_exports_the_tuned_actor_everywhere_the_same(tmp_path):
    cfg, ckpt = _config(tmp_path, "qwen3", "trainer.steps=2", "checkpoint.every_steps=2", "checkpoint.export_hf=true",
                        "task.eval_samples=2")
    assert cfg.model.family == "qwen3" and cfg.model.head_dim == 32 and cfg.model.name == "ckpt"
    summary = run_job(cfg, str(tmp_path / "run"))
    assert summary["model_source"] == str(ckpt)
    for key in ("accuracy_before", "accuracy_after", "pass_at_k_before", "pass_at_k_after"):
        assert 0.0 <= summary[key] <= 1.0
    assert summary["eval_samples"] == 2 and summary["warm_start_seconds"] == 0.0
    metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert {"reward_mean", "format_ok_fraction", "answer_correct_fraction"} <= set(metrics[0])
    run_hf = tmp_path / "run" / "hf"
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= {p.name for p in run_hf.iterdir()}
    _, start = load_hf(ckpt)
    _, final = load_hf(run_hf)
    moved = jax.tree.leaves(jax.tree.map(lambda x, y: float(np.abs(np.asarray(x) - y).max()), final, start))
    assert max(moved) > 0  # two GRPO updates changed the weights
    _, at_checkpoint = load_hf(tmp_path / "run" / "checkpoints" / "2" / "hf")
    _tree_equal(at_checkpoint, final)
    assert export_main([str(tmp_path / "run" / "checkpoints"), str(tmp_path / "exported")]) == 0
    cfg_out, exported = load_hf(tmp_path / "exported")
    _tree_equal(exported, final)
    assert cfg_out.family == "qwen3" and cfg_out.qk_norm
    assert (tmp_path / "exported" / "tokenizer.json").read_text() == (ckpt / "tokenizer.json").read_text()


def test_a_bfloat16_checkpoint_trains_in_float32_and_exports_in_bfloat16(tmp_path):
    ckpt = write_checkpoint(tmp_path / "ckpt", "llama", seed=2, dtype="bfloat16")
    prompts = write_prompts(tmp_path / "prompts.jsonl", 40)
    cfg = load_config(None, GRPO + [f"model.hf_path={ckpt}", f"task.prompt_file={prompts}", "trainer.steps=1"])
    assert cfg.model.param_dtype == "float32"
    run_job(cfg, str(tmp_path / "run"))
    from nereus_jax.models.hf import HFCheckpoint

    assert HFCheckpoint(tmp_path / "run" / "hf").dtype == "bfloat16"
    _, final = load_hf(tmp_path / "run" / "hf", dtype="bfloat16")
    assert {np.asarray(x).dtype.name for x in jax.tree.leaves(final)} == {"bfloat16"}
    assert json.loads((tmp_path / "run" / "hf" / "config.json").read_text())["dtype"] == "bfloat16"


def test_a_model_key_contradicting_the_checkpoint_names_both_values(tmp_path):
    from nereus_jax.config import ConfigError

    ckpt = write_checkpoint(tmp_path / "ckpt", "qwen2")
    with pytest.raises(ConfigError, match=r"model.num_layers=3 contradicts .* config.json gives 2"):
        load_config(None, [f"model.hf_path={ckpt}", "model.num_layers=3"])
    agreed = load_config(None, [f"model.hf_path={ckpt}", "model.num_layers=2", "model.compute_dtype=bfloat16"])
    assert agreed.model == model_config("qwen2").__class__(**{**model_config("qwen2").to_dict(), "name": "ckpt",
                                                             "hf_path": str(ckpt), "compute_dtype": "bfloat16",
                                                             "rope_scaling": None})
