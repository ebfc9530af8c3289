"""Peak memory and speed of one scoring and one training micro-batch with a real vocabulary, over vocabulary
chunks vs the whole logits tensor, in the same process.

    python tools/bench_vocab.py                      # V = 151,936 (Qwen3), 4,096 response tokens a micro-batch
    python tools/bench_vocab.py --vocab 128256 --tokens 8192 --chunk 16384 --repeats 5
    python tools/bench_vocab.py --quick              # a small shape (tests)

The model is Qwen3-shaped and tiny (2 layers, width 64, tied embeddings: ~10M parameters, almost all
embedding), so the output head is nearly all of a call, as in the issue's run. Scoring: actor-infer's
program (``response_stats``: the log-prob of every response token). Training: one ``make_train_step``
update of the PPO actor loss with the entropy bonus (AdamW). Peak bytes per device come from XLA's buffer
assignment of each compiled program (``memory_analysis``: arguments + temporaries + outputs that do not
reuse a donated input), the exact figure XLA allocates; the peak of a mode is the larger of its two
programs. Seconds are the median of ``--repeats`` rounds after a warm-up, each round calling the four programs
in turn (so both modes see the same moments of a shared host's load). The machine's limits are measured in the
same run: float32 matmul FLOP/s (a square matmul) and copy bandwidth (a large array copy); the head's
achieved FLOP/s is reported against the first. Prints one JSON object on its last line.
"""

from __future__ import annotations

import argparse
import json

import jax
import numpy as np
from machine_limits import actor_batch, copy_bytes_per_s, interleaved_median_seconds, matmul_flops_per_s, peak_bytes

from nereus_jax.config import AlgorithmConfig, ModelConfig
from nereus_jax.models import init_params
from nereus_jax.runtime.step import losses
from nereus_jax.vocab_chunks import DEFAULT_VOCAB_CHUNK, vocab_split


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--tokens", type=int, default=4096, help="response tokens per micro-batch")
    p.add_argument("--response", type=int, default=128, help="response length (rows = tokens / response)")
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--chunk", type=int, default=DEFAULT_VOCAB_CHUNK)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="V 8,192, 512 tokens, chunk 1,024, 2 repeats")
    args = p.parse_args()
    if args.quick:
        args.vocab, args.tokens, args.response, args.chunk, args.repeats = 8192, 512, 64, 1024, 2
    return args


def _model(vocab: int) -> ModelConfig:
    return ModelConfig(name="qwen3-tiny-real-vocab", family="qwen3", vocab_size=vocab, hidden_size=64, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=32, intermediate_size=128, qk_norm=True,
                       tie_embeddings=True, rms_norm_eps=1e-6)



def _programs(cfg, chunk: int, params, opt_state, batch, prompt: int):
    algo = AlgorithmConfig(kl_in_reward=False, entropy_coef=0.01)
    optimizer = losses.make_optimizer(1e-5)
    score = jax.jit(lambda p, mb: losses.response_stats(p, cfg, mb, prompt, vocab_chunk=chunk)[0])
    train = jax.jit(losses.make_train_step(losses.actor_loss(cfg, algo, prompt, vocab_chunk=chunk), optimizer, cfg))
    mb = {"tokens": batch["tokens"], "mask": batch["mask"]}
    micro = losses.split_micro({**batch, "denom": np.float32(batch["response_mask"].sum())}, 1)
    score_c = score.lower(params, mb).compile()
    train_c = train.lower(params, opt_state, micro).compile()
    return score_c, train_c, mb, micro


def run(args: argparse.Namespace) -> dict:
    cfg = _model(args.vocab)
    rows = args.tokens // args.response
    params = init_params(cfg, seed=0)
    opt_state = losses.make_optimizer(1e-5).init(params)
    batch = actor_batch(cfg.vocab_size, rows, args.prompt, args.response)
    logp, calls, out = {}, {}, {}
    for name, chunk in (("chunked", args.chunk), ("unchunked", 0)):
        score, train, mb, micro = _programs(cfg, chunk, params, opt_state, batch, args.prompt)
        logp[name] = np.asarray(score(params, mb))
        new_params = train(params, opt_state, micro)[0]
        logp[name + "_trained"] = np.asarray(losses.response_stats(new_params, cfg, mb, args.prompt, vocab_chunk=0)[0])
        calls[name, "score"] = lambda score=score, mb=mb: score(params, mb)
        calls[name, "train"] = lambda train=train, micro=micro: train(params, opt_state, micro)
        out[name] = {"score_peak_bytes": peak_bytes(score), "train_peak_bytes": peak_bytes(train)}
    for (name, what), seconds in interleaved_median_seconds(calls, args.repeats).items():
        out[name][what + "_seconds"] = seconds
    flops, gbps = matmul_flops_per_s(), copy_bytes_per_s()
    head_flops = 2.0 * args.tokens * cfg.hidden_size * cfg.vocab_size  # one pass of the head over the tokens
    c, u = out["chunked"], out["unchunked"]
    peak = {k: max(v["score_peak_bytes"], v["train_peak_bytes"]) for k, v in out.items()}
    n, padded = vocab_split(args.vocab, args.chunk)
    return {
        "vocab": args.vocab, "tokens": args.tokens, "rows": rows, "vocab_chunk": args.chunk, "chunks": n,
        "chunk_width": padded // n, "hidden_size": cfg.hidden_size, "params": int(sum(x.size for x in
                                                                                       jax.tree.leaves(params))),
        "chunked_peak_bytes": peak["chunked"], "unchunked_peak_bytes": peak["unchunked"],
        "peak_ratio": peak["chunked"] / peak["unchunked"],
        "score_peak_ratio": c["score_peak_bytes"] / u["score_peak_bytes"],
        "train_peak_ratio": c["train_peak_bytes"] / u["train_peak_bytes"],
        "chunked": c, "unchunked": u,
        "max_abs_diff": float(np.max(np.abs(logp["chunked"] - logp["unchunked"]))),
        "max_abs_diff_after_update": float(np.max(np.abs(logp["chunked_trained"] - logp["unchunked_trained"]))),
        "chunked_tokens_per_s": args.tokens / (c["score_seconds"] + c["train_seconds"]),
        "unchunked_tokens_per_s": args.tokens / (u["score_seconds"] + u["train_seconds"]),
        "speed_ratio": (u["score_seconds"] + u["train_seconds"]) / (c["score_seconds"] + c["train_seconds"]),
        "matmul_flops_per_s": flops, "copy_bytes_per_s": gbps,
        "chunked_score_head_flops_fraction": head_flops / c["score_seconds"] / flops,
        "chunked_train_head_flops_fraction": 4 * head_flops / c["train_seconds"] / flops,
        "device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
    }




def main() -> None:
    args = _parse()
    if args.tokens % args.response:
        raise SystemExit(f"--tokens ({args.tokens}) must be a multiple of --response ({args.response})")
    result = run(args)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
