"""LoRA dropout (``model.lora_dropout``) against its references: the mask's keep rate and scaling, the base
model (dropout never touches the frozen projection: with B = 0 the dropped forward is the base bit for bit),
the undropped train step (rate 0, or no key: bit for bit), reproducibility for a seed, the frozen base after
dropped updates (bit for bit), and PEFT's adapter_config."""

import dataclasses
import functools
import json
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nereus_jax.config import AlgorithmConfig, ConfigError, ModelConfig, load_config
from nereus_jax.model_stage import ACTOR_TRAIN, CRITIC_TRAIN
from nereus_jax.models import abstract_params, forward, lora
from nereus_jax.models.peft import write_adapter
from nereus_jax.runtime.step import losses
from nereus_jax.runtime.step.learner import Learner

P = 0.25
# two targets keep the compiles short: q_proj reads [b, t, embed], o_proj [b, t, heads, head_dim]
DROP = ModelConfig(family="qwen3", qk_norm=True, qkv_bias=True, vocab_size=128, hidden_size=64, num_layers=2,
                   num_heads=4, num_kv_heads=2, intermediate_size=96, lora_rank=4, lora_alpha=8.0, lora_dropout=P,
                   lora_targets=("q_proj", "o_proj"))
NO_DROP = dataclasses.replace(DROP, lora_dropout=0.0)
PROMPT, RESPONSE = 6, 5
OPTIMIZER = losses.make_optimizer(1e-2)


def _tokens(b=2, t=8, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, DROP.vocab_size, (b, t)), jnp.int32)


def _trained_b(params, std=0.1):
    """Adapters as after training (random B): at init B = 0 and the adapters, dropped or not, do nothing."""
    rng = np.random.default_rng(1)
    return jax.tree_util.tree_map_with_path(
        lambda path, x: jnp.asarray(rng.normal(0, std, x.shape), x.dtype) if path[-1].key.endswith(lora.SUFFIX_B)
        else x, params)


@pytest.fixture(scope="module")
def params():
    """Random weights (norm scales 1, B = 0) drawn on the host: a Decoder's eager init takes far longer."""
    rng = np.random.default_rng(0)

    def draw(path, x):
        name = path[-1].key
        if name.endswith(lora.SUFFIX_B):
            return jnp.zeros(x.shape, x.dtype)
        return jnp.ones(x.shape, x.dtype) if name == "scale" else jnp.asarray(rng.normal(0, 0.1, x.shape), x.dtype)

    return jax.tree_util.tree_map_with_path(draw, abstract_params(DROP))


def test_the_mask_keeps_one_minus_p_scales_by_its_inverse_and_repeats_for_a_key():
    x = jnp.ones((64, 32, 48), jnp.float32)
    keys = lora.row_keys(jax.random.PRNGKey(7), 1, 64)[0]  # one layer's keys, one per row
    y = np.asarray(lora.dropout(x, keys, "wq", DROP))
    kept = y != 0
    # 98,304 draws: the kept fraction's standard deviation is 0.0014, so 0.01 is 7 of them
    assert abs(kept.mean() - (1 - P)) < 0.01
    np.testing.assert_array_equal(y[kept], np.float32(1 / (1 - P)))
    np.testing.assert_array_equal(np.asarray(lora.dropout(x, keys, "wq", DROP)), y)  # the same key: the same mask
    other = lora.row_keys(jax.random.PRNGKey(8), 1, 64)[0]
    assert not np.array_equal(np.asarray(lora.dropout(x, other, "wq", DROP)) != 0, kept)
    # q, k and v read the same input through masks of their own (PEFT: one Dropout module per projection)
    assert not np.array_equal(np.asarray(lora.dropout(x, keys, "wk", DROP)) != 0, kept)
    # a row's mask is its key's, whatever rows come with it (a pipeline micro-batch, a dp shard): rows 1, 3, 5, ...
    # alone draw what they draw in the whole batch; and rows differ
    np.testing.assert_array_equal(np.asarray(lora.dropout(x[1::2], keys[1::2], "wq", DROP)), y[1::2])
    assert not np.array_equal(kept[0], kept[1])


_forward = jax.jit(forward, static_argnums=1)


def test_dropout_touches_the_adapters_only_and_runs_only_where_a_key_is_given(params):
    tokens, key = _tokens(), jax.random.PRNGKey(3)
    # B = 0: whatever the adapters read, the base projection reads its input whole, so the base bit for bit
    np.testing.assert_array_equal(np.asarray(_forward(params, DROP, tokens, dropout_key=key)),
                                  np.asarray(_forward(params, DROP, tokens)))
    trained = _trained_b(params)
    plain = np.asarray(_forward(trained, DROP, tokens))
    dropped = np.asarray(_forward(trained, DROP, tokens, dropout_key=key))
    assert np.abs(dropped - plain).max() > 1e-3
    np.testing.assert_array_equal(np.asarray(_forward(trained, DROP, tokens, dropout_key=key)), dropped)
    assert not np.array_equal(np.asarray(_forward(trained, DROP, tokens, dropout_key=jax.random.PRNGKey(4))),
                              dropped)
    # rate 0: a key changes nothing
    np.testing.assert_array_equal(np.asarray(_forward(trained, NO_DROP, tokens, dropout_key=key)),
                                  np.asarray(_forward(trained, NO_DROP, tokens)))


def _batches(mini=2, accum=2, rows=2, seed=3):
    rng = np.random.default_rng(seed)
    n, t = mini * accum * rows, PROMPT + RESPONSE
    data = {"tokens": rng.integers(1, DROP.vocab_size, (n, t)).astype(np.int32), "mask": np.ones((n, t), np.int32),
            "response_mask": np.ones((n, RESPONSE), np.float32),
            "advantages": rng.normal(size=(n, RESPONSE)).astype(np.float32),
            "old_logp": np.full((n, RESPONSE), -4.0, np.float32), "ref_logp": np.full((n, RESPONSE), -4.0, np.float32)}
    return data, mini, accum


@functools.cache
def _step(cfg):
    """The job's update program (two epochs over the mini-batches) for ``cfg``."""
    return jax.jit(losses.make_minibatch_train_step(losses.actor_loss(cfg, AlgorithmConfig(), PROMPT), OPTIMIZER,
                                                    cfg, epochs=2))


def _train(cfg, params, data, mini, accum, seed=None):
    """:func:`_step` on ``data`` with LoRA-dropout ``seed`` (None: none)."""
    data = data if seed is None else data | {"dropout_seed": np.uint32(seed)}
    batches = {k: jnp.asarray(v) for k, v in losses.split_minibatches(data, mini, accum).items()}
    out, _, metrics = _step(cfg)(params, losses.init_opt_state(OPTIMIZER, params, cfg), batches)
    assert not np.any(np.asarray(metrics["nonfinite"]))
    return jax.tree.map(np.asarray, out)


def _equal(a, b) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def test_dropped_updates_repeat_for_a_seed_differ_across_seeds_and_leave_the_base_bit_identical(params):
    trained = _trained_b(params)
    data, mini, accum = _batches()
    plain = _train(NO_DROP, trained, data, mini, accum)  # today's step: no dropout (the learner adds no seed)
    dropped = _train(DROP, trained, data, mini, accum, seed=5)
    assert _equal(_train(DROP, trained, data, mini, accum, seed=5), dropped)
    assert not _equal(dropped, plain)
    assert not _equal(_train(DROP, trained, data, mini, accum, seed=6), dropped)
    frozen = lora.split_trainable(jax.tree.map(np.asarray, trained), DROP)[1]
    assert _equal(lora.split_trainable(dropped, DROP)[1], frozen)  # the frozen base: no gradient, no update


def test_the_learner_seeds_dropout_by_job_seed_step_and_stage_and_not_at_all_without_it():
    def seed(cfg, step, ms=ACTOR_TRAIN):
        return Learner.dropout_seed(types.SimpleNamespace(cfg=cfg), step, ms)

    cfg = load_config(None, ["model.lora_rank=4", "model.lora_dropout=0.1"])
    assert seed(cfg, 3) == seed(cfg, 3)
    assert len({int(seed(cfg, 3)["dropout_seed"]), int(seed(cfg, 4)["dropout_seed"]),
                int(seed(cfg, 3, CRITIC_TRAIN)["dropout_seed"])}) == 3
    other = load_config(None, ["model.lora_rank=4", "model.lora_dropout=0.1", "trainer.seed=1"])
    assert seed(other, 3) != seed(cfg, 3)
    assert seed(load_config(None, ["model.lora_rank=4"]), 3) == {}


def test_the_peft_adapter_config_carries_the_dropout(params, tmp_path):
    out = write_adapter(tmp_path / "adapter", DROP, jax.tree.map(np.asarray, params), base_model="base")
    assert json.loads((out / "adapter_config.json").read_text())["lora_dropout"] == P


def test_bad_dropout_settings_are_refused_with_the_fix():
    with pytest.raises(ConfigError, match=r"lora_dropout=1.0 must be in \[0, 1\)"):
        dataclasses.replace(DROP, lora_dropout=1.0)
    with pytest.raises(ConfigError, match="set model.lora_rank or model.lora_dropout=0"):
        dataclasses.replace(NO_DROP, lora_rank=0, lora_dropout=0.1)



def test_the_controller_proposes_pipelined_training_stages_with_dropout():
    """The pipeline schedules carry the dropout keys (tests/runtime/test_lora_job.py compares pp 2 with pp 1), so a
    pipelined training plan is a candidate with dropout as without."""
    from nereus_jax.runtime.control.job_pricer import JobPricer
    from nereus_jax.runtime.step.initial_plan import plan_from_config

    lora = ["model.lora_rank=4", "plan.colocate=false", "plan.stages.actor-gen.dp=2"]
    pipelined = plan_from_config(load_config(None, lora + ["plan.stages.actor-train.pp=2"]))
    flat = plan_from_config(load_config(None, lora))

    def runnable(plan, *extra):
        pricer = types.SimpleNamespace(job=types.SimpleNamespace(cfg=load_config(None, lora + list(extra))),
                                       async_mode=False)
        return JobPricer.runnable(pricer, plan)

    assert runnable(pipelined) and runnable(flat, "model.lora_dropout=0.1")
    assert runnable(pipelined, "model.lora_dropout=0.1")


def test_a_move_compiles_ahead_for_the_seed_the_steps_pass(devices):
    """prepare_programs compiles a target plan's train program from the recorded input signature
    (stages._abstract_micro): its abstract seed must be what the learner's seed becomes on the mesh."""
    from nereus_jax.runtime.step.stages import _abstract_micro, _put
    from nereus_jax.sharding import Layout, make_mesh

    mesh = make_mesh(devices[:2], Layout(), dp=2)
    data, mini, accum = _batches()
    data |= {"dropout_seed": np.uint32(5)}
    real = _put(losses.split_minibatches(data, mini, accum), mesh, mini)
    signature = {k: (np.shape(v), np.asarray(v).dtype) for k, v in data.items()}
    ahead = _abstract_micro(signature, accum, mesh, mini)
    assert ahead.keys() == real.keys()
    for k, x in real.items():
        assert (ahead[k].shape, ahead[k].dtype, ahead[k].sharding) == (x.shape, x.dtype, x.sharding), k
