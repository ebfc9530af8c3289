"""Tiny local Hugging Face checkpoints for job tests: a byte-level BPE tokenizer trained here with
``tokenizers`` (ChatML special tokens and chat template, eos list in generation_config.json), model weights
from ``init_params`` written by ``save_hf`` (or by transformers in the parity tests), and prompt files of
arithmetic questions in chat form with numeric answers."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from nereus_jax.config import ModelConfig

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# ChatML as Qwen's checkpoints write it, without tools (our own short template, not a vendor's).
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
CORPUS = [f"What is {a} plus {b}? {a} + {b} = {a + b}. The answer is \\boxed{{{a + b}}}." for a in range(12)
          for b in range(12)]


@cache
def tokenizer_json() -> str:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=300, special_tokens=list(SPECIALS), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    return tok.to_str()


def vocab_size() -> int:
    return Tokenizer.from_str(tokenizer_json()).get_vocab_size()


def write_tokenizer(folder: Path) -> None:
    """tokenizer.json, tokenizer_config.json (ChatML template, eos <|im_end|>, pad <|endoftext|>, no bos) and
    generation_config.json (both eos ids) in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(tokenizer_json())
    tok = Tokenizer.from_str(tokenizer_json())
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
              "pad_token": "<|endoftext|>", "chat_template": CHATML}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    eos = [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eos, "pad_token_id": eos[1]}))


def model_config(family: str) -> ModelConfig:
    """A tiny model of ``family`` whose vocabulary covers the tokenizer (and a little more, as real ones do)."""
    extra = {"qwen3": dict(qk_norm=True, head_dim=32), "qwen2": dict(qkv_bias=True, tie_embeddings=True),
             "llama": {}}[family]
    return ModelConfig(name=f"tiny-{family}", family=family, vocab_size=vocab_size() + 4, hidden_size=64,
                       num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, rms_norm_eps=1e-6,
                       max_position_embeddings=256, **extra)


def write_checkpoint(folder: Path, family: str, seed: int = 0, dtype: str | None = None) -> Path:
    """A random tiny ``family`` model saved by ``save_hf``, with the tokenizer files."""
    from nereus_jax.models import init_params, save_hf

    cfg = model_config(family)
    save_hf(folder, cfg, init_params(cfg, seed=seed), dtype=dtype)
    write_tokenizer(folder)
    return folder


def write_prompts(path: Path, count: int, offset: int = 0) -> Path:
    """``count`` chat prompts {"prompt": [{"role": "user", ...}], "answer": "N"} as JSONL."""
    with open(path, "w") as f:
        for i in range(offset, offset + count):
            a, b = i % 9 + 1, (i * 5) % 7 + 1
            row = {"prompt": [{"role": "user", "content": f"What is {a} plus {b}?"}], "answer": str(a + b)}
            f.write(json.dumps(row) + "\n")
    return path
