"""Makes a small "pretrained" chat model to post-train: a Hugging Face folder (Qwen3-shaped decoder, BPE
tokenizer, ChatML chat template) that solves arithmetic word problems some of the time, and the prompts
to post-train and evaluate it on.

    .venv312/bin/python tools/make_pretrained.py --out runs/tiny-math        # ~5-10 minutes on 2 CPU cores
    python -m nereus_jax.train configs/hf_grpo_tiny.yaml model.hf_path=runs/tiny-math/model --run-dir runs/rl
    .venv311/bin/python tools/eval_hf.py runs/rl/hf runs/tiny-math/eval.jsonl    # transformers' greedy accuracy

What it does (CPU only; one JAX device; deterministic for a given --seed):

1. generates a corpus of arithmetic word problems from six templates (buying, giving away, losing, two people
   together, groups of, buying then giving away; + and - up to two digits, x up to 9 x 9) with solutions of
   one or two sentences of reasoning ending in ``\\boxed{N}``; every question text is unique and the
   corpus splits into SFT training, SFT validation, RL training (``--out/train.jsonl``) and a held-out
   evaluation set (``--out/eval.jsonl``, in neither). The SFT split carries a misconception
   (``--misconception``, default 0.6): in that fraction of its solutions with a giving-away or losing step
   (three of the six templates) the step adds instead of subtracting, so the supervised model answers those
   wrongly when greedy but samples the right operation some of the time, which a verifiable reward can
   correct; every other split's answers are right;
2. trains a byte-level BPE tokenizer on it with ``tokenizers`` (digits are always single tokens; special
   tokens ``<|endoftext|>`` (pad), ``<|im_start|>``, ``<|im_end|>`` (eos), no bos) and writes
   ``tokenizer.json``, ``tokenizer_config.json`` with a chat template of our own in Qwen's ChatML format
   (``<|im_start|>role\\ncontent<|im_end|>\\n`` per message, ``<|im_start|>assistant\\n`` with
   ``add_generation_prompt``) and ``generation_config.json`` (eos ids);
3. supervises a small Qwen3-shaped decoder (``family: qwen3``: q/k RMSNorm, explicit head_dim; ~0.4M
   parameters) on chat-rendered prompt -> solution pairs, with the loss on the response tokens only, using
   the job's own training step (:mod:`nereus_jax.runtime.step.losses`), ``--max-steps`` steps: long enough that its
   arithmetic is mostly right, so the misconception is most of what RL can correct. Every ``--check-every``
   steps the greedy accuracy on the validation split is measured with the job's inference engine and math
   reward (``--target-accuracy`` stops training once it is reached: a fixed number of steps is the default,
   since an early stop on a 128-problem split lands on noisy, chaotic points);
4. saves ``--out/model`` (config.json + model.safetensors via :func:`nereus_jax.models.save_hf`, the
   tokenizer files) and prints one JSON line: paths, SFT steps, validation accuracy, seconds.

Prompts are rendered by :class:`nereus_jax.rl.tokenizer.HFTokenizer` from the files just written, exactly
as the RL job renders them. JSONL rows: ``{"prompt": [{"role": "user", "content": "..."}], "answer": "8"}``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
PAD, EOS = "<|endoftext|>", "<|im_end|>"
# Our own template in Qwen's ChatML format (not copied from a Qwen checkpoint).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

NAMES = ("Tom", "Anna", "Ben", "Mia", "Sam", "Lily", "Max", "Emma", "Leo", "Zoe", "Jack", "Nora")
ITEMS = ("apples", "pencils", "marbles", "stickers", "cookies", "books", "cards", "shells", "coins", "flowers")
BOXES = ("boxes", "bags", "rows", "baskets", "packs", "jars")


# ------------------------------------------------------------------------------------------------ corpus
@dataclass(frozen=True)
class Example:
    question: str
    solution: str  # a sentence or two of reasoning ending in \boxed{answer}
    answer: str


def _example(question: str, reasoning: str, answer: int) -> Example:
    return Example(question, f"{reasoning} \\boxed{{{answer}}}", str(answer))


def _buy(rng: random.Random) -> Example:
    n, item, a, b = rng.choice(NAMES), rng.choice(ITEMS), rng.randint(2, 29), rng.randint(2, 19)
    return _example(f"{n} has {a} {item} and buys {b} more. How many {item} does {n} have now?",
                    f"Buying {b} more gives {a} + {b} = {a + b}.", a + b)


def _give(rng: random.Random) -> Example:
    n, m = rng.sample(NAMES, 2)
    item, a = rng.choice(ITEMS), rng.randint(10, 39)
    b = rng.randint(2, a - 1)
    return _example(f"{n} has {a} {item} and gives {b} of them to {m}. How many {item} does {n} have left?",
                    f"Giving {b} away leaves {a} - {b} = {a - b}.", a - b)


def _lose(rng: random.Random) -> Example:
    n, item, a = rng.choice(NAMES), rng.choice(ITEMS), rng.randint(10, 39)
    b = rng.randint(2, a - 1)
    return _example(f"{n} had {a} {item} and lost {b} of them. How many {item} does {n} have now?",
                    f"Losing {b} leaves {a} - {b} = {a - b}.", a - b)


def _together(rng: random.Random) -> Example:
    n, m = rng.sample(NAMES, 2)
    item, a, b = rng.choice(ITEMS), rng.randint(2, 29), rng.randint(2, 19)
    return _example(f"{n} has {a} {item} and {m} has {b} {item}. How many {item} do they have together?",
                    f"Together they have {a} + {b} = {a + b}.", a + b)


def _groups(rng: random.Random) -> Example:
    box, item, a, b = rng.choice(BOXES), rng.choice(ITEMS), rng.randint(2, 9), rng.randint(2, 9)
    return _example(f"There are {a} {box} with {b} {item} in each. How many {item} are there in all?",
                    f"{a} groups of {b} make {a} × {b} = {a * b}.", a * b)


def _buy_then_give(rng: random.Random) -> Example:
    n, m = rng.sample(NAMES, 2)
    item, a, b = rng.choice(ITEMS), rng.randint(2, 19), rng.randint(2, 9)
    c = rng.randint(2, a + b - 1)
    s, r = a + b, a + b - c
    return _example(f"{n} has {a} {item}, buys {b} more and then gives {c} to {m}. How many {item} does {n} have?",
                    f"Buying gives {a} + {b} = {s}. Giving {c} away leaves {s} - {c} = {r}.", r)


TEMPLATES = (_buy, _give, _together, _lose, _groups, _buy_then_give)


def problems(seed: int) -> Iterator[Example]:
    """An endless deterministic stream of distinct problems (no question text twice)."""
    seen: set[str] = set()
    for i in range(10**9):
        rng = random.Random(f"tiny-math/{seed}/{i}")
        ex = TEMPLATES[i % len(TEMPLATES)](rng)
        if ex.question not in seen:
            seen.add(ex.question)
            yield ex


def make_splits(seed: int, sizes: dict[str, int]) -> dict[str, list[Example]]:
    """Disjoint splits, in the order of ``sizes``, cut from one stream of distinct problems."""
    stream, out = problems(seed), {}
    for name, size in sizes.items():
        out[name] = [next(stream) for _ in range(size)]
    return out


MISTAKE = re.compile(r"(Giving|Losing) (\d+)( away)? leaves (\d+) - (\d+) = (\d+)\.")


def misconceive(examples: Sequence[Example], fraction: float, seed: int) -> list[Example]:
    """The corpus's misconception: in ``fraction`` of the solutions with a giving-away or losing step (giving
    away, losing, buying then giving away) that step adds instead of subtracting ("Giving 3 away leaves
    12 + 3 = 15."), with the wrong boxed answer. A model supervised on it
    answers those problems wrongly when greedy yet samples the right operation some of the time, which is
    what a verifiable reward can correct (the RL prompts and held-out answers are always right)."""
    rng, out = random.Random(f"tiny-math/misconception/{seed}"), []
    for e in examples:
        m = MISTAKE.search(e.solution)
        if m and rng.random() < fraction:
            verb, b, away, a = m.group(1), int(m.group(2)), m.group(3) or "", int(m.group(4))
            before = e.solution[:m.start()]
            e = _example(e.question, f"{before}{verb} {b}{away} leaves {a} + {b} = {a + b}.", a + b)
        out.append(e)
    return out


# --------------------------------------------------------------------------------------------- tokenizer
def chat_messages(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}]


def train_tokenizer(examples: Sequence[Example], vocab_size: int):
    """Byte-level BPE over the chat-rendered corpus; digits are split off one by one before BPE, so every
    number is spelt digit by digit (a fixed-size vocabulary for arithmetic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    texts = (f"<|im_start|>user\n{e.question}<|im_end|>\n<|im_start|>assistant\n{e.solution}<|im_end|>\n"
             for e in examples)
    tok.train_from_iterator(texts, trainer)
    return tok


def write_tokenizer(out: Path, tok, max_length: int) -> None:
    """tokenizer.json, tokenizer_config.json (special tokens, chat template) and generation_config.json."""
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    added = {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                      "special": True} for t, i in ids.items()}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": EOS, "pad_token": PAD,
              "unk_token": None, "add_bos_token": False, "add_prefix_space": False,
              "clean_up_tokenization_spaces": False, "model_max_length": max_length,
              "added_tokens_decoder": added, "chat_template": CHAT_TEMPLATE}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"eos_token_id": [ids[EOS], ids[PAD]], "pad_token_id": ids[PAD], "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def load_tokenizer(model_dir: Path):
    """The job's tokenizer over the files just written (prompts rendered exactly as the RL job renders them)."""
    from nereus_jax.rl.tokenizer import HFTokenizer

    return HFTokenizer(str(model_dir))


# ------------------------------------------------------------------------------------------------- model
def model_config(vocab_size: int, args: argparse.Namespace):
    from nereus_jax.config import ModelConfig

    return ModelConfig(name="tiny-math", family="qwen3", qk_norm=True, vocab_size=vocab_size, hidden_size=args.hidden,
                       num_layers=args.layers, num_heads=args.heads, num_kv_heads=args.kv_heads, head_dim=args.head_dim,
                       intermediate_size=args.intermediate, rope_theta=10000.0, rms_norm_eps=1e-6,
                       tie_embeddings=True, max_position_embeddings=args.max_positions)


def encode_sft(examples: Sequence[Example], tok, prompt_len: int, response_len: int) -> dict:
    """Chat-rendered prompt (left-padded to P) + solution + eos (right-padded to R): the layout of
    :mod:`nereus_jax.rl.batch`, with the loss mask on the response only."""
    import numpy as np

    from nereus_jax.rl.batch import left_pad, right_pad

    prompts = [tok.encode_prompt(chat_messages(e.question)) for e in examples]
    responses = [tok.encode(e.solution) + [tok.eos_id] for e in examples]
    _check_fits("prompt", prompts, prompt_len, "--prompt-length")
    _check_fits("solution", responses, response_len, "--response-length")
    prompt, prompt_mask = left_pad(prompts, prompt_len, tok.pad_id)
    response, response_mask = right_pad(responses, response_len, tok.pad_id)
    return {"tokens": np.concatenate([prompt, response], 1), "mask": np.concatenate([prompt_mask, response_mask], 1),
            "response_mask": response_mask}


def _check_fits(what: str, seqs: Sequence[Sequence[int]], limit: int, flag: str) -> None:
    longest = max(len(s) for s in seqs)
    if longest > limit:
        raise SystemExit(f"a {what} has {longest} tokens but {flag}={limit}: raise {flag}")


class GreedyEval:
    """Greedy accuracy of parameters on a fixed set of problems, through the job's inference engine and
    the same stop tokens, decoding and math reward as the job's held-out evaluation (``rewarder``:
    :func:`nereus_jax.rl.rewards.make_rewarder` for ``task.reward=math``)."""

    def __init__(self, cfg, tok, examples: Sequence[Example], prompt_len: int, response_len: int, rewarder):
        from nereus_jax.engine import JaxEngine, SamplingParams
        from nereus_jax.rl.tasks import Problem

        self.tok, self.rewarder = tok, rewarder
        self.problems = [Problem(tuple(chat_messages(e.question)), e.answer, f"validation:{i}")
                         for i, e in enumerate(examples)]
        self.prompts = [tok.encode_prompt(chat_messages(e.question)) for e in examples]
        self.engine = JaxEngine(cfg, max_concurrent_decodes=64, max_prefill_length=prompt_len,
                                max_target_length=prompt_len + response_len, max_prefill_batch=16,
                                max_stop_tokens=max(4, len(tok.eos_ids)))
        self.sampling = SamplingParams(temperature=0.0, max_new_tokens=response_len, stop_tokens=tuple(tok.eos_ids))

    def texts(self, params) -> list[str]:
        from nereus_jax.engine import Generator

        out = Generator(self.engine, self.engine.load_params(params), pad_id=self.tok.pad_id).rollouts(
            self.prompts, self.sampling)
        return [self.tok.decode(t[:n].tolist()) for t, n in zip(out.tokens, out.lengths, strict=True)]

    def accuracy(self, params) -> float:
        return float(self.rewarder.score(self.problems, self.texts(params)).correct.mean())


def supervise(params: dict, cfg, data: dict, evaluate: GreedyEval, args: argparse.Namespace,
              log=print) -> tuple[dict, int, float]:
    """``--max-steps`` supervised steps on ``data`` (rows drawn in a shuffled order, epoch after epoch), the
    greedy validation accuracy checked every ``--check-every`` steps (and at the end); with
    ``--target-accuracy``, stopping once it reaches that. Returns (params, steps, last validation accuracy)."""
    import jax
    import numpy as np

    from nereus_jax.runtime.step.losses import make_optimizer, make_train_step, sft_loss, split_micro

    opt = make_optimizer(args.lr)
    step_fn = jax.jit(make_train_step(sft_loss(cfg, args.prompt_length), opt, cfg), donate_argnums=(0, 1))
    opt_state, rng = opt.init(params), np.random.default_rng(args.seed)
    order, accuracy, rows = np.empty(0, np.int64), 0.0, len(data["tokens"])
    for step in range(1, args.max_steps + 1):
        if len(order) < args.batch:
            order = np.concatenate([order, rng.permutation(rows)])
        idx, order = order[: args.batch], order[args.batch:]
        batch = {k: v[idx] for k, v in data.items()}
        batch["denom"] = np.float32(batch["response_mask"].sum())
        params, opt_state, metrics = step_fn(params, opt_state, split_micro(batch, 1))
        if step % args.check_every == 0 or step == args.max_steps:
            accuracy = evaluate.accuracy(params)
            log(f"sft step {step}: loss {float(metrics['loss']):.4f}, validation greedy accuracy {accuracy:.3f}")
            if args.target_accuracy is not None and accuracy >= args.target_accuracy:
                break
    return params, step, accuracy


# -------------------------------------------------------------------------------------------------- main
def write_jsonl(path: Path, examples: Sequence[Example]) -> None:
    with path.open("w") as f:
        for e in examples:
            f.write(json.dumps({"prompt": chat_messages(e.question), "answer": e.answer}) + "\n")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/tiny-math", help="output folder (model/, train.jsonl, eval.jsonl)")
    p.add_argument("--seed", type=int, default=0, help="corpus, initialisation and data order")
    p.add_argument("--target-accuracy", type=float, default=None,
                   help="stop SFT early once the validation greedy accuracy reaches this (default: all steps)")
    p.add_argument("--max-steps", type=int, default=800, help="SFT steps (at most, with --target-accuracy)")
    p.add_argument("--check-every", type=int, default=200, help="SFT steps between validation checks")
    p.add_argument("--batch", type=int, default=64, help="problems per SFT step")
    p.add_argument("--lr", type=float, default=3e-3, help="SFT learning rate (AdamW)")
    p.add_argument("--misconception", type=float, default=0.6,
                   help="fraction of SFT solutions with a giving-away or losing step that add instead of subtracting")
    p.add_argument("--sft-size", type=int, default=20000, help="problems in the SFT split")
    p.add_argument("--valid-size", type=int, default=128, help="problems in the SFT validation split")
    p.add_argument("--train-size", type=int, default=4000, help="RL prompts (train.jsonl)")
    p.add_argument("--eval-size", type=int, default=256, help="held-out prompts (eval.jsonl)")
    p.add_argument("--vocab-size", type=int, default=512, help="BPE vocabulary at most (the corpus needs ~470)")
    p.add_argument("--prompt-length", type=int, default=40, help="tokens of a chat-rendered prompt, at most")
    p.add_argument("--response-length", type=int, default=40, help="tokens of a solution + eos, at most")
    p.add_argument("--hidden", type=int, default=96)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=24)
    p.add_argument("--intermediate", type=int, default=256)
    p.add_argument("--max-positions", type=int, default=256)
    return p.parse_args(argv)


def make_pretrained(args: argparse.Namespace, log=print) -> dict:
    """Everything the module docstring lists; returns the summary printed as JSON."""
    from nereus_jax.config import TaskConfig
    from nereus_jax.models import count_params, init_params, save_hf
    from nereus_jax.rl.rewards import make_rewarder

    start, out = time.perf_counter(), Path(args.out)
    model_dir = out / "model"
    splits = make_splits(args.seed, {"eval": args.eval_size, "valid": args.valid_size, "train": args.train_size,
                                     "sft": args.sft_size})
    splits["sft"] = misconceive(splits["sft"], args.misconception, args.seed)
    write_tokenizer(model_dir, train_tokenizer(splits["sft"], args.vocab_size), args.max_positions)
    tok = load_tokenizer(model_dir)
    cfg = model_config(tok.vocab_size, args)
    data = encode_sft(splits["sft"], tok, args.prompt_length, args.response_length)
    for name in ("valid", "train", "eval"):  # every prompt and solution fits the RL config's lengths
        encode_sft(splits[name], tok, args.prompt_length, args.response_length)
    params = init_params(cfg, seed=args.seed)
    log(f"{count_params(params):,} parameters, vocabulary {tok.vocab_size}, {len(splits['sft'])} SFT problems")
    sft_start = time.perf_counter()
    with make_rewarder(TaskConfig(reward="math"), None, workers=1) as rewarder:
        evaluate = GreedyEval(cfg, tok, splits["valid"], args.prompt_length, args.response_length, rewarder)
        params, steps, accuracy = supervise(params, cfg, data, evaluate, args, log)
    sft_seconds = time.perf_counter() - sft_start
    save_hf(model_dir, cfg, _host(params), extra_config=_special_ids(tok))
    write_jsonl(out / "train.jsonl", splits["train"])
    write_jsonl(out / "eval.jsonl", splits["eval"])
    return {"model": str(model_dir), "train": str(out / "train.jsonl"), "eval": str(out / "eval.jsonl"),
            "params": count_params(params), "vocab_size": tok.vocab_size, "sft_steps": steps,
            "validation_accuracy": accuracy, "target_accuracy": args.target_accuracy,
            "sft_seconds": round(sft_seconds, 1), "seconds": round(time.perf_counter() - start, 1)}


def _host(params: dict) -> dict:
    import jax
    import numpy as np

    return jax.tree.map(np.asarray, params)


def _special_ids(tok) -> dict:
    return {"bos_token_id": None, "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id}


def main(argv: Sequence[str] | None = None) -> int:
    summary = make_pretrained(parse_args(argv), log=lambda msg: print(msg, file=sys.stderr, flush=True))
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
