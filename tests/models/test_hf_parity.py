"""Parity with Hugging Face transformers on tiny random Llama / Qwen2 / Qwen3 models: logits and pooled scores
within 1e-4, bit-exact export round trips, loading onto tensor-parallel layouts, and import errors.

Run: ``.venv311/bin/python -m pytest tests/models/test_hf_parity.py -q`` (torch + transformers needed;
without them the module skips, unless ``NEREUS_REQUIRE_HF=1``, which turns the skip into a failure).
"""

import dataclasses
import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from nereus_jax.config import ModelConfig, RopeScalingConfig
from nereus_jax.models import forward, init_params
from nereus_jax.models.hf import HFImportError, hf_config_from_model, load_hf, model_config_from_hf, save_hf
from nereus_jax.sharding import Layout, gather_params, make_mesh, shard_params

if os.environ.get("NEREUS_REQUIRE_HF") == "1":
    import torch
    import transformers
else:
    _WHY = "Hugging Face parity needs torch and transformers (pip install -e '.[hf]' on Python 3.11)"
    torch = pytest.importorskip("torch", reason=_WHY)
    transformers = pytest.importorskip("transformers", reason=_WHY)

PAD = 0
SMALL = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, rms_norm_eps=1e-6, max_position_embeddings=128,
             initializer_range=0.2,  # weights large enough that a mapping bug moves logits well past 1e-4
             attn_implementation="eager")
# original_max_position_embeddings=16 puts the llama3 wavelength bounds (16 and 4) among the frequencies of a
# 16-wide head, so the scaling changes the logits at positions < 12.
LLAMA3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=16)
MODELS = {
    "llama_lm": ("LlamaForCausalLM", "LlamaConfig", dict(rope_theta=500000.0, rope_scaling=LLAMA3,
                                                         tie_word_embeddings=False)),
    "qwen_lm": ("Qwen2ForCausalLM", "Qwen2Config", dict(tie_word_embeddings=True)),
    "llama_cls": ("LlamaForSequenceClassification", "LlamaConfig", dict(rope_theta=500000.0, rope_scaling=LLAMA3,
                                                                        num_labels=1, pad_token_id=PAD)),
    "qwen_cls": ("Qwen2ForSequenceClassification", "Qwen2Config", dict(num_labels=1, pad_token_id=PAD)),
    "qwen_cls2": ("Qwen2ForSequenceClassification", "Qwen2Config", dict(num_labels=2, pad_token_id=PAD)),
    # Qwen3: per-head q_norm/k_norm; head_dim 32 set apart from hidden / heads = 16.
    "qwen3_lm": ("Qwen3ForCausalLM", "Qwen3Config", dict(head_dim=32, rope_theta=1e6, tie_word_embeddings=False)),
    "qwen3_cls": ("Qwen3ForSequenceClassification", "Qwen3Config", dict(head_dim=32, num_labels=1,
                                                                         pad_token_id=PAD)),
}


def _randomise_norms_and_biases(model, seed: int) -> None:
    """HF initialises norm scales to one and biases to zero; random values make their mapping matter."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """Each tiny HF model built once (seeded, float32, eager attention) and saved with save_pretrained."""
    transformers.utils.logging.disable_progress_bar()
    built = {}
    for seed, (key, (cls_name, config_name, kw)) in enumerate(MODELS.items()):
        torch.manual_seed(seed)
        config = getattr(transformers, config_name)(**SMALL, **kw)
        model = getattr(transformers, cls_name)(config).eval()
        assert model.config._attn_implementation == "eager"
        _randomise_norms_and_biases(model, seed)
        path = tmp_path_factory.mktemp(key)
        model.save_pretrained(path)
        built[key] = SimpleNamespace(path=path, model=model, cls=getattr(transformers, cls_name))
    return built


@pytest.fixture(scope="module")
def batch():
    """3 rows of 12: one full, one left-padded by 4, one right-padded by 3; positions count real tokens."""
    rng = np.random.RandomState(0)
    mask = np.ones((3, 12), np.int64)
    mask[1, :4] = 0
    mask[2, 9:] = 0
    tokens = np.where(mask == 1, rng.randint(1, 128, (3, 12)), PAD)
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    return SimpleNamespace(tokens=tokens, mask=mask, positions=positions, last=(np.arange(12) * mask).argmax(1))


def _hf_out(model, b) -> np.ndarray:
    with torch.no_grad():
        out = model(input_ids=torch.tensor(b.tokens), attention_mask=torch.tensor(b.mask),
                    position_ids=torch.tensor(b.positions), use_cache=False)
    return out.logits.numpy()


def _ours(params, cfg, b) -> np.ndarray:
    return np.asarray(forward(params, cfg, jnp.asarray(b.tokens), jnp.asarray(b.positions), jnp.asarray(b.mask)))


def _tensors(path: Path) -> dict[str, np.ndarray]:
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, framework="np") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118
    return out


def _copy_with(src: Path, dst: Path, *, drop: str | None = None, replace: dict | None = None) -> Path:
    shutil.copytree(src, dst)
    tensors = _tensors(src)
    tensors.pop(drop, None)
    tensors.update(replace or {})
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


# --------------------------------------------------------------------------------------------- logits
@pytest.mark.parametrize("key", ["llama_lm", "qwen_lm", "qwen3_lm"])
def test_hf_parity_causal_lm_logits_match_on_padded_batch(hf_models, batch, key):
    hf = hf_models[key]
    cfg, params = load_hf(hf.path)
    ref = _hf_out(hf.model, batch)
    ours = _ours(params, cfg, batch)
    assert ours.shape == ref.shape == (3, 12, 128)
    real = batch.mask == 1
    np.testing.assert_allclose(ours[real], ref[real], atol=1e-4, rtol=0)


def test_hf_parity_llama3_rope_scaling_is_applied_by_both(hf_models, batch):
    hf = hf_models["llama_lm"]
    assert hf.model.config.rope_parameters["rope_type"] == "llama3"
    cfg, params = load_hf(hf.path)
    assert cfg.rope_scaling is not None and cfg.rope_scaling.original_max_position_embeddings == 16
    unscaled = _ours(params, dataclasses.replace(cfg, rope_scaling=None), batch)
    real = batch.mask == 1
    assert np.abs(unscaled[real] - _hf_out(hf.model, batch)[real]).max() > 1e-2


def test_hf_parity_qwen3_qk_norms_and_wide_heads_are_imported(hf_models, batch):
    hf = hf_models["qwen3_lm"]
    assert hf.model.config.head_dim == 32 != hf.model.config.hidden_size // hf.model.config.num_attention_heads
    cfg, params = load_hf(hf.path)
    assert (cfg.family, cfg.qk_norm, cfg.head_dim, cfg.qkv_bias) == ("qwen3", True, 32, False)
    attn = hf.model.model.layers[1].self_attn
    for name, module in (("q_norm", attn.q_norm), ("k_norm", attn.k_norm)):
        np.testing.assert_array_equal(params["layers"]["attn"][name]["scale"][1], module.weight.detach().numpy())
    real = batch.mask == 1  # the norms matter: skipping them moves the logits far past 1e-4
    unnormed = _ours(params, dataclasses.replace(cfg, family="llama", qk_norm=False), batch)
    assert np.abs(unnormed[real] - _hf_out(hf.model, batch)[real]).max() > 1e-2


def test_hf_parity_qwen2_biases_and_tied_head_are_imported(hf_models):
    cfg, params = load_hf(hf_models["qwen_lm"].path)
    assert cfg.family == "qwen2" and cfg.qkv_bias and cfg.tie_embeddings and "lm_head" not in params
    assert all(np.abs(params["layers"]["attn"][b]).max() > 0.1 for b in ("bq", "bk", "bv"))


# ----------------------------------------------------------------------------------- pooled scores
@pytest.mark.parametrize("key, labels", [("llama_cls", 1), ("qwen_cls", 1), ("qwen_cls2", 2), ("qwen3_cls", 1)])
def test_hf_parity_sequence_classification_scores_match_value_head(hf_models, batch, key, labels):
    hf = hf_models[key]
    cfg, params = load_hf(hf.path)
    assert set(params) >= {"value_head"} and "lm_head" not in params
    ref = _hf_out(hf.model, batch)  # pooled at each row's last non-pad token
    values = _ours(params, cfg, batch)
    assert values.shape == (3, 12, labels) and ref.shape == (3, labels)
    np.testing.assert_allclose(values[np.arange(3), batch.last], ref, atol=1e-4, rtol=0)


# ------------------------------------------------------------------------------------------ export
@pytest.mark.parametrize("key", ["llama_lm", "qwen_lm", "qwen_cls2", "qwen3_lm", "qwen3_cls"])
def test_hf_parity_export_round_trip_is_bit_exact(hf_models, batch, key, tmp_path):
    hf = hf_models[key]
    cfg, params = load_hf(hf.path)
    extra = {"pad_token_id": PAD} if "cls" in key else None
    save_hf(tmp_path, cfg, params, extra_config=extra)
    original, exported = _tensors(hf.path), _tensors(tmp_path)
    assert sorted(exported) == sorted(original)  # a tied model writes no lm_head.weight, like HF
    for name, x in original.items():
        assert exported[name].dtype == x.dtype and np.array_equal(exported[name], x), name
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    assert config.architectures == [hf.cls.__name__]
    reloaded = hf.cls.from_pretrained(tmp_path, attn_implementation="eager").eval()
    np.testing.assert_array_equal(_hf_out(reloaded, batch), _hf_out(hf.model, batch))
    assert model_config_from_hf(json.loads((tmp_path / "config.json").read_text()), name=cfg.name) == cfg


@pytest.mark.parametrize("cfg", [
    ModelConfig(family="llama", qkv_bias=True, rope_theta=500000.0, rms_norm_eps=1e-6,
                rope_scaling=RopeScalingConfig(original_max_position_embeddings=16)),
    ModelConfig(family="qwen2", qkv_bias=False, tie_embeddings=True, head_dim=32),
    ModelConfig(family="qwen3", qk_norm=True, qkv_bias=True, head_dim=32, rms_norm_eps=1e-6),
], ids=["llama_qkv_bias", "qwen2_no_bias_wide_heads", "qwen3_attention_bias"])
def test_hf_parity_export_of_our_random_model_matches_in_transformers(cfg, batch, tmp_path):
    """Our-side parameters (not from HF) through save_hf: Llama's and Qwen3's qkv bias go out with a zero
    o_proj bias, a bias-free Qwen2 with zero biases (HF Qwen2 always has them); explicit head_dim != hidden /
    heads. transformers finds every tensor it expects (none initialised at random)."""
    rng = np.random.RandomState(1)
    params = jax.tree.map(lambda x: (0.2 * rng.standard_normal(x.shape)).astype(np.float32), init_params(cfg, seed=1))
    params["layers"]["attn_norm"]["scale"] += 1.0
    if cfg.qk_norm:
        for name in ("q_norm", "k_norm"):
            params["layers"]["attn"][name]["scale"] += 1.0
    save_hf(tmp_path / "export", cfg, params)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "export", attn_implementation="eager", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    real = batch.mask == 1
    np.testing.assert_allclose(_hf_out(model.eval(), batch)[real], _ours(params, cfg, batch)[real], atol=1e-4,
                               rtol=0)
    if cfg.family != "qwen2":  # an o_proj bias our decoder cannot hold is refused, naming it
        name = "model.layers.1.self_attn.o_proj.bias"
        _copy_with(tmp_path / "export", tmp_path / "biased", replace={name: np.ones(64, np.float32)})
        with pytest.raises(HFImportError, match=name):
            load_hf(tmp_path / "biased")


def test_hf_parity_sharded_export_of_laid_out_params(hf_models, batch, devices, tmp_path):
    hf = hf_models["llama_lm"]
    cfg, params = load_hf(hf.path)
    layout = Layout(tp=4)  # exceeds the 2 kv heads: the laid-out tree stores each kv head twice
    laid_out = shard_params(params, cfg, layout, make_mesh(devices[:4], layout))
    save_hf(tmp_path, cfg, gather_params(laid_out, cfg), max_shard_bytes=40_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1 and not (tmp_path / "model.safetensors").exists()
    original = _tensors(hf.path)
    assert sorted(index["weight_map"]) == sorted(original)
    assert all(np.array_equal(_tensors(tmp_path)[k], x) for k, x in original.items())
    reloaded = hf.cls.from_pretrained(tmp_path, attn_implementation="eager").eval()
    np.testing.assert_array_equal(_hf_out(reloaded, batch), _hf_out(hf.model, batch))
    _, again = load_hf(tmp_path)
    jax.tree.map(np.testing.assert_array_equal, again, params)


def test_hf_parity_bfloat16_checkpoint_loads_casts_and_exports(hf_models, tmp_path):
    hf = hf_models["qwen_lm"]
    bf16 = hf.cls.from_pretrained(hf.path, dtype=torch.bfloat16)
    bf16.save_pretrained(tmp_path / "bf16")
    cfg, as_f32 = load_hf(tmp_path / "bf16")
    _, as_bf16 = load_hf(tmp_path / "bf16", dtype="bfloat16")
    assert as_f32["embed"]["embedding"].dtype == np.float32 and as_bf16["embed"]["embedding"].dtype == jnp.bfloat16
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b.astype(np.float32)), as_f32, as_bf16)
    save_hf(tmp_path / "out", cfg, as_bf16)
    original, exported = _tensors(tmp_path / "bf16"), _tensors(tmp_path / "out")
    assert sorted(exported) == sorted(original)
    assert all(exported[k].dtype == x.dtype and np.array_equal(exported[k], x) for k, x in original.items())


# -------------------------------------------------------------------------------- sharded loading
@pytest.mark.parametrize("key", ["llama_lm", "qwen_lm", "qwen3_lm"])
@pytest.mark.parametrize("tp", [2, 4])
def test_hf_parity_loading_onto_tensor_parallel_layout(hf_models, batch, devices, key, tp):
    hf = hf_models[key]
    cfg, params = load_hf(hf.path)
    layout = Layout(tp=tp)
    sharded = shard_params(params, cfg, layout, make_mesh(devices[:tp], layout))
    for leaf in jax.tree.leaves(sharded):
        assert isinstance(leaf, jax.Array) and len(leaf.sharding.device_set) == tp
    wq, wk = sharded["layers"]["attn"]["wq"], sharded["layers"]["attn"]["wk"]
    assert wq.sharding.spec[2] == "tp" and wk.sharding.spec[2] == "tp"
    assert wk.shape[2] == max(tp, cfg.num_kv_heads)  # tp=4 > 2 kv heads: each stored twice
    run = jax.jit(forward, static_argnums=1)
    out = np.asarray(run(sharded, cfg, jnp.asarray(batch.tokens), jnp.asarray(batch.positions),
                         jnp.asarray(batch.mask)))
    real = batch.mask == 1
    # tp splits the wo and w_down contractions into partial sums that are all-reduced: float32 summation order
    # differs, which on logits of magnitude ~7 reaches ~1e-5, hence the relative term.
    np.testing.assert_allclose(out[real], _ours(params, cfg, batch)[real], atol=1e-5, rtol=1e-5)
    jax.tree.map(np.testing.assert_array_equal, gather_params(sharded, cfg), params)


# ------------------------------------------------------------------------------------------ errors
def test_hf_parity_missing_tensor_is_named(hf_models, tmp_path):
    name = "model.layers.1.mlp.up_proj.weight"
    path = _copy_with(hf_models["llama_lm"].path, tmp_path / "ckpt", drop=name)
    with pytest.raises(HFImportError, match=rf"{name}.*missing"):
        load_hf(path)


def test_hf_parity_wrong_shape_names_tensor_and_shapes(hf_models, tmp_path):
    name = "model.layers.0.self_attn.k_proj.weight"
    bad = np.zeros((16, 64), np.float32)
    path = _copy_with(hf_models["llama_lm"].path, tmp_path / "ckpt", replace={name: bad})
    with pytest.raises(HFImportError, match=rf"{name}.*\(16, 64\).*\(32, 64\)"):
        load_hf(path)


def test_hf_parity_unsupported_rope_type_names_the_key(hf_models, tmp_path):
    path = shutil.copytree(hf_models["llama_lm"].path, tmp_path / "ckpt")
    config = json.loads((path / "config.json").read_text())
    config["rope_parameters"]["rope_type"] = "yarn"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(HFImportError, match=r"rope_parameters\.rope_type='yarn'.*supported"):
        load_hf(path)


def _llama_config(hf_models) -> dict:
    return json.loads((hf_models["llama_lm"].path / "config.json").read_text())


@pytest.mark.parametrize("change, key", [
    ({"rope_parameters": None, "rope_scaling": {"type": "linear", "factor": 2.0}}, r"rope_scaling\.rope_type"),
    ({"model_type": "gemma"}, "model_type"),
    ({"architectures": ["LlamaForTokenClassification"]}, "architectures"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"use_sliding_window": True, "sliding_window": 8}, "use_sliding_window"),
    ({"layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"hidden_size": None}, "hidden_size"),
])
def test_hf_parity_unsupported_config_raises_naming_the_key(hf_models, change, key):
    with pytest.raises(HFImportError, match=key):
        model_config_from_hf({**_llama_config(hf_models), **change})


def test_hf_parity_unreadable_directory_raises(hf_models, tmp_path):
    with pytest.raises(HFImportError, match="not a directory"):
        load_hf(tmp_path / "absent")
    with pytest.raises(HFImportError, match="config.json"):
        load_hf(tmp_path)
    shutil.copy(hf_models["llama_lm"].path / "config.json", tmp_path / "config.json")
    with pytest.raises(HFImportError, match="safetensors"):
        load_hf(tmp_path)


# --------------------------------------------------------------------------------- config spellings
def test_hf_parity_transformers4_config_spelling_reads_the_same(hf_models):
    v5 = _llama_config(hf_models)
    v4 = {k: v for k, v in v5.items() if k != "rope_parameters"}
    rope = dict(v5["rope_parameters"])
    v4.update(rope_theta=rope.pop("rope_theta"), rope_scaling=rope)
    assert model_config_from_hf(v4) == model_config_from_hf(v5)
    parsed = transformers.LlamaConfig.from_dict(v4)  # transformers agrees on what the old spelling means
    assert parsed.rope_parameters == v5["rope_parameters"]


def test_hf_parity_exported_config_is_what_transformers_reads(hf_models):
    cfg, _ = load_hf(hf_models["llama_cls"].path)
    exported = hf_config_from_model(cfg, head="value", num_labels=3)
    parsed = transformers.AutoConfig.for_model(**exported)
    assert parsed.num_labels == 3 and parsed.architectures == ["LlamaForSequenceClassification"]
    assert parsed.rope_parameters == {**exported["rope_scaling"], "rope_theta": cfg.rope_theta}
    assert model_config_from_hf(exported, name=cfg.name) == cfg
