"""Supervised warm start: learns, caches atomically, reloads bit-exact into any layout."""

import os

import jax
import numpy as np

from nereus_jax.config import load_config
from nereus_jax.models import forward, init_params
from nereus_jax.rl.tasks import Problem, make_task
from nereus_jax.rl.tokenizer import CharTokenizer
from nereus_jax.runtime.durability.warmstart import (
    cached_warm_start,
    encode_sft,
    teacher_forced_accuracy,
)
from nereus_jax.sharding import Layout, gather_params, make_mesh, shard_params

CFG = load_config(None, ["rollout.max_prompt_length=12", "rollout.max_response_length=8",
                         "trainer.warmup_sft_steps=3", "trainer.sft_batch=16"])
TOK = CharTokenizer()


def _greedy(params, tokens, mask, n):
    """Reference greedy decoding: a full forward over the growing sequence, n tokens."""
    tokens, mask, out = list(tokens), list(mask), []
    for _ in range(n):
        nxt = int(np.asarray(forward(params, CFG.model, np.array([tokens]), None, np.array([mask])))[0, -1].argmax())
        out.append(nxt)
        tokens, mask = tokens + [nxt], mask + [1]
    return out


def test_teacher_forced_accuracy_equals_greedy_decoding():
    params = init_params(CFG.model, seed=0)
    batch = encode_sft([Problem("1+2=", "3"), Problem("4+4=", "8")], TOK, 12, 8)
    for i in range(2):  # make each row's "answer" the model's own greedy continuation (3 tokens)
        batch["tokens"][i, 12:15] = _greedy(params, batch["tokens"][i, :12], batch["mask"][i, :12], 3)
    batch["response_mask"][:] = 0
    batch["response_mask"][:, :3] = 1
    batch["mask"] = np.concatenate([batch["mask"][:, :12], batch["response_mask"]], 1)
    assert teacher_forced_accuracy(params, CFG.model, batch, 12) == 1.0
    batch["tokens"][1, 14] = (batch["tokens"][1, 14] + 1) % CFG.model.vocab_size  # row 1 no longer greedy
    assert teacher_forced_accuracy(params, CFG.model, batch, 12) == 0.5


def test_warm_start_is_cached_and_reloads_bit_exact_into_another_layout(tmp_path, devices):
    task = make_task(CFG.task)
    mesh = make_mesh(devices[:2], Layout(1), dp=2)
    params = shard_params(init_params(CFG.model, 0), CFG.model, Layout(1), mesh)
    before = gather_params(params, CFG.model)
    trained, hit = cached_warm_start(params, CFG, task, TOK, mesh, str(tmp_path))  # donates params
    assert not hit and len(os.listdir(tmp_path)) == 1
    after = gather_params(trained, CFG.model)
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after),
                                                         strict=True))
    mesh4 = make_mesh(devices[:4], Layout(4))
    fresh = shard_params(init_params(CFG.model, 0), CFG.model, Layout(4), mesh4)
    again, hit = cached_warm_start(fresh, CFG, task, TOK, mesh4, str(tmp_path))
    assert hit
    jax.tree.map(np.testing.assert_array_equal, gather_params(again, CFG.model), after)
    assert again["layers"]["attn"]["wk"].shape[2] == 4  # kv heads stored per tp=4 rank
