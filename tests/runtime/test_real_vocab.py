"""A checkpoint with a real vocabulary (Qwen3's 151,936 tokens, tied embeddings, 2 layers of width 64:
almost all of its ~10M parameters are the embedding) post-trains through ``run_job`` with the defaults:
the memory model's predicted peak per device is checked against the peak the CPU devices reached (live
bytes at a program's start plus XLA's temporaries and new outputs), and a plan that cannot fit is refused
with its fix named before anything is compiled."""

import dataclasses
import json

import pytest
from hf_checkpoints import model_config, write_prompts, write_tokenizer

from nereus_jax.config import load_config
from nereus_jax.runtime.run import check_inputs, run_job
from nereus_jax.runtime.step.initial_plan import predicted_peak, with_micro_batch_tokens
from nereus_jax.runtime.step.stages import JobError

pytestmark = pytest.mark.slow

QWEN3_VOCAB = 151_936
JOB = ["algorithm.name=grpo", "rollout.samples_per_prompt=4", "rollout.max_prompt_length=48",
       "rollout.max_response_length=16", "trainer.prompts_per_step=8", "task.name=file", "task.reward=math",
       "task.eval_size=8", "logging.progress=false", "logging.tensorboard=false", "controller.enabled=false"]


@pytest.fixture(scope="module")
def real_vocab(tmp_path_factory):
    from nereus_jax.models import init_params, save_hf

    folder = tmp_path_factory.mktemp("qwen3_vocab")
    cfg = dataclasses.replace(model_config("qwen3"), vocab_size=QWEN3_VOCAB, tie_embeddings=True)
    save_hf(folder / "ckpt", cfg, init_params(cfg, seed=0))
    write_tokenizer(folder / "ckpt")
    prompts = write_prompts(folder / "prompts.jsonl", 24)
    return [f"model.hf_path={folder / 'ckpt'}", f"task.prompt_file={prompts}"]


def test_the_predicted_peak_is_within_a_quarter_of_the_measured_one(real_vocab, tmp_path):
    cfg = load_config(None, JOB + real_vocab + ["trainer.steps=2"])
    assert cfg.model.vocab_size == QWEN3_VOCAB and cfg.trainer.micro_batch_tokens is None
    run_job(cfg, str(tmp_path / "run"))
    steps = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 2
    for m in steps:
        assert not m["over_memory_cap"]
        assert m["device_peak_bytes"] > 0
        assert abs(m["predicted_peak_bytes"] / m["device_peak_bytes"] - 1) <= 0.25, m
    # Whole logits: a replica's 4 rows x 16 response positions x 151,936 float32 logits are 38.9 MB, and a
    # training micro-batch holds 3 such arrays where the chunked one holds 4 of 64 x 8,192: the model counts them.
    whole = load_config(None, JOB + real_vocab + ["trainer.vocab_chunk=0"])
    logits = 4 * 16 * QWEN3_VOCAB * 4
    assert predicted_peak(with_micro_batch_tokens(whole))[0] - steps[0]["predicted_peak_bytes"] > 2.5 * logits


def test_a_plan_that_cannot_fit_is_refused_and_a_null_budget_shrinks_to_fit(real_vocab):
    cfg = load_config(None, JOB + real_vocab + ["trainer.vocab_chunk=0"])
    fits = with_micro_batch_tokens(cfg)
    big, _ = predicted_peak(fits)
    one_row = load_config(None, JOB + real_vocab + ["trainer.vocab_chunk=0", "trainer.micro_batch_tokens=64"])
    small, _ = predicted_peak(one_row)
    assert small < big
    cap = int((small + big) / 2 / (1 - cfg.controller.memory_headroom))  # the smallest budget fits, the largest not
    fixed = load_config(None, JOB + real_vocab + ["trainer.vocab_chunk=0", f"trainer.micro_batch_tokens={4096}",
                                                  f"cluster.device_memory_bytes={cap}"])
    with pytest.raises(JobError, match="lower trainer.micro_batch_tokens"):
        check_inputs(fixed, log=lambda _: None)
    auto = load_config(None, JOB + real_vocab + ["trainer.vocab_chunk=0", f"cluster.device_memory_bytes={cap}"])
    chosen = with_micro_batch_tokens(auto)
    assert 64 <= chosen.trainer.micro_batch_tokens < fits.trainer.micro_batch_tokens
    peak, usable = predicted_peak(chosen)
    assert peak <= usable
    check_inputs(auto, log=lambda _: None)  # the null budget is what the job runs: accepted
