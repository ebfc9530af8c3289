"""LoRA adapters against their references: the base model (B = 0 at init, bit for bit), the merged-weight model
(within 1e-5), one device (sharded, with kv heads repeated), and training that never touches the base."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nereus_jax.config import AlgorithmConfig, ModelConfig
from nereus_jax.engine import Generator, JaxEngine, SamplingParams
from nereus_jax.models import forward, init_params, lora
from nereus_jax.models.peft import AdapterError, read_adapter, write_adapter
from nereus_jax.runtime.step import losses
from nereus_jax.sharding import Layout, activation_sharding, gather_params, make_mesh, shard_params

# Qwen3-shaped (q/k norms, biases) with every projection adapted; 4 heads over 2 kv heads so tp 4 repeats them
LORA = ModelConfig(family="qwen3", qk_norm=True, qkv_bias=True, vocab_size=128, hidden_size=64, num_layers=2,
                   num_heads=4, num_kv_heads=2, intermediate_size=96, lora_rank=4, lora_alpha=8.0)
BASE = lora.base_config(LORA)


def _tokens(b, t, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, LORA.vocab_size, (b, t)), jnp.int32)


def _strip(params):
    """The base tree inside a LoRA tree."""
    return {**params, "layers": {g: {k: v for k, v in grp.items() if not lora.is_adapter((k,))}
                                 for g, grp in params["layers"].items()}}


def _trained_b(params, seed=1, std=0.05):
    """Adapters as after training: random B (at init it is zero and the adapters do nothing)."""
    rng = np.random.default_rng(seed)

    def fill(path, x):
        if path[-1].key.endswith(lora.SUFFIX_B):
            return jnp.asarray(rng.normal(0, std, x.shape), x.dtype)
        return x

    return jax.tree_util.tree_map_with_path(fill, params)


@pytest.fixture(scope="module")
def params():
    return init_params(LORA, seed=0)


def test_every_target_gets_a_and_b_of_the_documented_shapes(params):
    attn, mlp = params["layers"]["attn"], params["layers"]["mlp"]
    assert attn["wq_lora_a"].shape == (2, 64, 4) and attn["wq_lora_b"].shape == (2, 4, 4, 16)
    assert attn["wk_lora_b"].shape == (2, 4, 2, 16) and attn["wo_lora_a"].shape == (2, 4, 16, 4)
    assert attn["wo_lora_b"].shape == (2, 4, 64)
    assert mlp["w_down_lora_a"].shape == (2, 96, 4) and mlp["w_gate_lora_b"].shape == (2, 4, 96)
    assert all(not np.any(np.asarray(v)) for k, v in {**attn, **mlp}.items() if k.endswith("_lora_b"))
    only_q = init_params(dataclasses.replace(LORA, lora_targets=("q_proj",)), seed=0)
    assert [k for g in only_q["layers"].values() for k in g if "lora" in k] == ["wq_lora_a", "wq_lora_b"]


def test_at_init_the_model_is_the_base_bit_for_bit(params):
    tokens, mask = _tokens(2, 9), jnp.array([[0] * 3 + [1] * 6, [1] * 9])
    got = np.asarray(forward(params, LORA, tokens, None, mask))
    want = np.asarray(forward(_strip(params), BASE, tokens, None, mask))
    np.testing.assert_array_equal(got, want)


def test_unmerged_forward_equals_the_merged_weights(params):
    trained = _trained_b(params)
    tokens, mask = _tokens(3, 11, seed=2), jnp.array([[0] * 4 + [1] * 7, [1] * 11, [0] + [1] * 10])
    got = np.asarray(forward(trained, LORA, tokens, None, mask))
    merged = lora.merge_lora(jax.tree.map(np.asarray, trained), LORA)
    assert not lora.has_adapters(merged["layers"])
    want = np.asarray(forward(merged, BASE, tokens, None, mask))
    base = np.asarray(forward(_strip(trained), BASE, tokens, None, mask))
    assert np.abs(got - base).max() > 1e-2  # the adapters matter here
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    # merge on device (jax arrays, the engine's path) gives the same weights as on the host (numpy)
    on_device = lora.merge_lora(trained, LORA)
    for x, y in zip(jax.tree.leaves(on_device), jax.tree.leaves(merged), strict=True):
        np.testing.assert_allclose(np.asarray(x), y, atol=1e-6, rtol=0)


@pytest.mark.parametrize("tp", [2, 4])
def test_sharded_lora_forward_matches_one_device(params, devices, tp):
    """tp 4 exceeds the 2 kv heads: k/v_proj's B is stored repeated, like wk / wv."""
    trained = _trained_b(params)
    tokens, mask = _tokens(2, 9, seed=6), jnp.array([[0] * 3 + [1] * 6, [1] * 9])
    ref = np.asarray(forward(trained, LORA, tokens, None, mask))
    layout = Layout(tp=tp)
    mesh = make_mesh(devices[:tp], layout)
    sharded = shard_params(jax.tree.map(np.asarray, trained), LORA, layout, mesh)
    assert sharded["layers"]["attn"]["wk_lora_b"].shape[2] == LORA.num_kv_heads * max(1, tp // LORA.num_kv_heads)
    with activation_sharding(mesh, "train"):
        logits = jax.jit(forward, static_argnums=1)(sharded, LORA, tokens, None, mask)
    np.testing.assert_allclose(np.asarray(logits), ref, atol=1e-5, rtol=0)
    back = gather_params(sharded, LORA)
    for x, y in zip(jax.tree.leaves(back), jax.tree.leaves(trained), strict=True):
        np.testing.assert_array_equal(x, np.asarray(y))


def _batch(rows=4, prompt=6, response=5, seed=3):
    rng = np.random.default_rng(seed)
    t = prompt + response
    return {"tokens": jnp.asarray(rng.integers(1, LORA.vocab_size, (rows, t)), jnp.int32),
            "mask": jnp.ones((rows, t), jnp.int32),
            "response_mask": jnp.ones((rows, response), jnp.float32),
            "advantages": jnp.asarray(rng.normal(size=(rows, response)), jnp.float32),
            "old_logp": jnp.zeros((rows, response), jnp.float32) - 4.0,
            "ref_logp": jnp.zeros((rows, response), jnp.float32) - 4.0,
            "denom": jnp.float32(rows * response), "seq_denom": jnp.float32(rows)}


def test_training_updates_only_the_adapters_and_keeps_the_base_bit_identical(params):
    algo = AlgorithmConfig()
    optimizer = losses.make_optimizer(1e-2)
    loss = losses.actor_loss(LORA, algo, 6)
    step = jax.jit(losses.make_train_step(loss, optimizer, LORA))
    state = losses.init_opt_state(optimizer, params, LORA)
    # optimizer state for the adapters alone: Adam's two moments per adapter leaf (plus its step count)
    adapters = [x for p, x in jax.tree_util.tree_leaves_with_path(params) if lora.is_adapter(tuple(k.key for k in p))]
    assert sum(x.size for x in jax.tree.leaves(state)) == 2 * sum(x.size for x in adapters) + 1
    batch = jax.tree.map(lambda x: x[None] if x.ndim else x[None], _batch())
    p = params
    for _ in range(5):
        p, state, metrics = step(p, state, batch)
        assert float(metrics["nonfinite"]) == 0.0
    for path, before in jax.tree_util.tree_leaves_with_path(params):
        after = p
        for k in path:
            after = after[k.key]
        name = tuple(k.key for k in path)
        if lora.is_adapter(name):
            if name[-1].endswith(lora.SUFFIX_B):
                assert np.any(np.asarray(after) != 0), f"{name} did not train"
        else:
            np.testing.assert_array_equal(np.asarray(after), np.asarray(before), err_msg=str(name))


def test_the_value_head_trains_with_the_adapters():
    assert lora.is_trainable(("value_head", "kernel"), LORA) and not lora.is_trainable(("embed", "embedding"), LORA)
    assert lora.is_trainable(("embed", "embedding"), BASE)
    tree = init_params(LORA, seed=0, head="value")
    trainable, frozen = lora.split_trainable(tree, LORA)
    assert "value_head" in trainable and "embed" in frozen and "wq_lora_a" in trainable["layers"]["attn"]
    assert lora.join(trainable, frozen).keys() == tree.keys()


def test_the_engine_generates_with_the_adapters_merged(params):
    """The engine given a LoRA tree generates what it generates given the merged base tree."""
    trained = jax.tree.map(np.asarray, _trained_b(params, std=0.2))
    merged = lora.merge_lora(trained, LORA)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    sampling = SamplingParams(temperature=0.0, max_new_tokens=8)
    outs = []
    for cfg, tree in ((LORA, trained), (BASE, merged)):
        engine = JaxEngine(cfg, max_concurrent_decodes=2, max_prefill_length=8, max_target_length=32)
        outs.append(Generator(engine, engine.load_params(tree)).rollouts(prompts, sampling))
    np.testing.assert_array_equal(outs[0].tokens, outs[1].tokens)
    base = JaxEngine(BASE, max_concurrent_decodes=2, max_prefill_length=8, max_target_length=32)
    plain = Generator(base, base.load_params(_strip(trained))).rollouts(prompts, sampling)
    assert not np.array_equal(plain.tokens, outs[0].tokens)  # the adapters change what is generated


def test_a_peft_folder_round_trips_bit_exact_and_misfits_are_named(params, tmp_path):
    trained = jax.tree.map(np.asarray, _trained_b(params))
    out = write_adapter(tmp_path / "adapter", LORA, trained, base_model="base")
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    back = read_adapter(out, LORA)
    for g in trained["layers"].values():
        for k, v in g.items():
            if lora.is_adapter((k,)):
                np.testing.assert_array_equal(back[k], v)
    with pytest.raises(AdapterError, match="lora_rank=8"):
        read_adapter(out, dataclasses.replace(LORA, lora_rank=8))
    with pytest.raises(AdapterError, match="lora_targets"):
        read_adapter(out, dataclasses.replace(LORA, lora_targets=("q_proj",)))
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        read_adapter(tmp_path, LORA)


def test_bad_lora_settings_are_refused_with_the_fix():
    from nereus_jax.config import ConfigError

    with pytest.raises(ConfigError, match="unknown"):
        dataclasses.replace(LORA, lora_targets=("qproj",))
    with pytest.raises(ConfigError, match="lora_dropout"):
        dataclasses.replace(LORA, lora_dropout=1.0)
    with pytest.raises(ConfigError, match="lora_rank"):
        dataclasses.replace(BASE, lora_path="/x")
