"""Round trip with transformers (CI's Python 3.11 lane, ``-k hf_parity``): tiny random Llama, Qwen2 and Qwen3
checkpoints made by transformers, with a BPE tokenizer and a chat template, go through 2 GRPO steps of
``python -m nereus_jax.train``'s job; ``RUN_DIR/hf`` loads with ``AutoModelForCausalLM``, its logits equal our
forward of the exported parameters within 1e-4 (float32), and transformers' greedy ``generate`` on a
chat-rendered prompt gives the same tokens as our engine.

Run: ``NEREUS_REQUIRE_HF=1 .venv311/bin/python -m pytest tests/runtime/test_hf_roundtrip.py -q``.
"""

import os

import jax
import numpy as np
import pytest
from hf_checkpoints import CHATML, model_config, write_prompts, write_tokenizer

from nereus_jax.config import load_config
from nereus_jax.engine import Generator, JaxEngine, SamplingParams
from nereus_jax.models import forward, load_hf
from nereus_jax.rl.tokenizer import HFTokenizer
from nereus_jax.runtime.run import run_job

if os.environ.get("NEREUS_REQUIRE_HF") == "1":
    import torch
    import transformers
else:
    _WHY = "Hugging Face parity needs torch and transformers (pip install -e '.[hf]' on Python 3.11)"
    torch = pytest.importorskip("torch", reason=_WHY)
    transformers = pytest.importorskip("transformers", reason=_WHY)

pytestmark = pytest.mark.slow
CLASSES = {"llama": ("LlamaForCausalLM", "LlamaConfig"), "qwen2": ("Qwen2ForCausalLM", "Qwen2Config"),
           "qwen3": ("Qwen3ForCausalLM", "Qwen3Config")}
R = 8


def _transformers_checkpoint(folder, family: str, seed: int):
    """A tiny random ``family`` model initialised and saved by transformers (float32, eager attention)."""
    cfg = model_config(family)
    cls_name, config_name = CLASSES[family]
    kw = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
              num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
              intermediate_size=cfg.intermediate_size, rms_norm_eps=cfg.rms_norm_eps,
              max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=cfg.tie_embeddings,
              initializer_range=0.2, attn_implementation="eager")
    if family == "qwen3":
        kw["head_dim"] = cfg.head_dim
    torch.manual_seed(seed)
    model = getattr(transformers, cls_name)(getattr(transformers, config_name)(**kw)).eval()
    model.save_pretrained(folder)
    write_tokenizer(folder)
    return folder


@pytest.mark.parametrize("family", sorted(CLASSES))
def test_two_grpo_steps_export_a_checkpoint_transformers_loads_and_agrees_with_hf_parity(tmp_path, family):
    ckpt = _transformers_checkpoint(tmp_path / "ckpt", family, seed=len(family))
    prompts = write_prompts(tmp_path / "prompts.jsonl", 40)
    cfg = load_config(None, [
        f"model.hf_path={ckpt}", "algorithm.name=grpo", "algorithm.kl_estimator=k3", "algorithm.kl_in_reward=false",
        "rollout.samples_per_prompt=2", "rollout.max_prompt_length=24", f"rollout.max_response_length={R}",
        "trainer.prompts_per_step=8", "trainer.steps=2", "trainer.actor_lr=1e-3", "plan.stages.actor-gen.dp=2",
        "task.name=file", f"task.prompt_file={prompts}", "task.reward=math", "task.eval_size=8",
        "logging.progress=false", "logging.tensorboard=false", "controller.enabled=false"])
    run_job(cfg, str(tmp_path / "run"))
    out = tmp_path / "run" / "hf"
    ours_cfg, params = load_hf(out)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert type(theirs).__name__ == CLASSES[family][0]

    tok = HFTokenizer(str(out))
    assert tok.chat_template == CHATML
    prompt = tok.encode_prompt([{"role": "user", "content": "What is 3 plus 4?"}])
    tokens = np.asarray([prompt + [5, 17, 40, 2]], np.int64)
    with torch.no_grad():
        want = theirs(torch.from_numpy(tokens)).logits.numpy()
    got = np.asarray(forward(params, ours_cfg, jax.numpy.asarray(tokens, jax.numpy.int32)))
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)

    with torch.no_grad():
        generated = theirs.generate(torch.from_numpy(np.asarray([prompt])), max_new_tokens=R, do_sample=False,
                                    eos_token_id=list(tok.eos_ids), pad_token_id=tok.pad_id)
    theirs_new = generated[0, len(prompt):].tolist()
    engine = JaxEngine(ours_cfg, max_concurrent_decodes=2, max_prefill_length=32, max_target_length=32 + R)
    gen = Generator(engine, engine.load_params(params), pad_id=tok.pad_id)
    result = gen.rollouts([prompt], SamplingParams(temperature=0.0, max_new_tokens=R, stop_tokens=tuple(tok.eos_ids)))
    ours_new = result.tokens[0, : result.lengths[0]].tolist()
    # transformers keeps the eos it stopped at and pads after it; ours ends at (and includes) the stop token
    assert ours_new == theirs_new[: len(ours_new)] and (len(ours_new) == R or ours_new[-1] in tok.eos_ids)
