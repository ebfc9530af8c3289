"""LoRA parity with peft on tiny random Qwen3 / Llama models: our adapter export loaded by peft on the base
gives our logits within 1e-4; our merged export equals peft's ``merge_and_unload``; an adapter peft wrote
loads into ours (``read_adapter``) and gives peft's logits.

Run: ``.venv311/bin/python -m pytest tests/models/test_lora_peft.py -q`` (torch, transformers and peft; without
them the module skips, unless ``NEREUS_REQUIRE_HF=1``).
"""

import dataclasses
import os
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nereus_jax.models import forward, lora
from nereus_jax.models.hf import load_hf
from nereus_jax.models.peft import read_adapter, write_adapter

if os.environ.get("NEREUS_REQUIRE_HF") == "1":
    import peft
    import torch
    import transformers
else:
    _WHY = "LoRA parity needs torch, transformers and peft (pip install -e '.[hf]' on Python 3.11)"
    torch = pytest.importorskip("torch", reason=_WHY)
    transformers = pytest.importorskip("transformers", reason=_WHY)
    peft = pytest.importorskip("peft", reason=_WHY)

SMALL = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=96, rms_norm_eps=1e-6, max_position_embeddings=128, initializer_range=0.2,
             attn_implementation="eager")
FAMILIES = {"qwen3": ("Qwen3ForCausalLM", "Qwen3Config", dict(head_dim=32, tie_word_embeddings=False)),
            "llama": ("LlamaForCausalLM", "LlamaConfig", dict(tie_word_embeddings=True))}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def base(request, tmp_path_factory):
    cls_name, config_name, kw = FAMILIES[request.param]
    torch.manual_seed(0)
    model = getattr(transformers, cls_name)(getattr(transformers, config_name)(**SMALL, **kw)).eval()
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    cfg, params = load_hf(path)
    return SimpleNamespace(path=path, cls=getattr(transformers, cls_name), cfg=cfg, params=params)


@pytest.fixture(scope="module")
def batch():
    rng = np.random.RandomState(0)
    mask = np.ones((2, 10), np.int64)
    mask[1, :3] = 0
    tokens = np.where(mask == 1, rng.randint(1, 128, (2, 10)), 0)
    return SimpleNamespace(tokens=tokens, mask=mask, positions=np.maximum(np.cumsum(mask, axis=1) - 1, 0))


def _trained(base, targets=lora.ALL_TARGETS):
    """Our base plus adapters with random A and B (as after training), rank 4, alpha 8."""
    cfg = dataclasses.replace(base.cfg, lora_rank=4, lora_alpha=8.0, lora_targets=tuple(targets))
    tree = lora.with_adapters(base.params, cfg, seed=1)
    rng = np.random.default_rng(2)
    for g in tree["layers"].values():
        for k in list(g):
            if k.endswith(lora.SUFFIX_B):
                g[k] = rng.normal(0, 0.1, g[k].shape).astype(np.float32)
    return cfg, tree


def _hf_logits(model, b):
    with torch.no_grad():
        return model(input_ids=torch.tensor(b.tokens), attention_mask=torch.tensor(b.mask),
                     position_ids=torch.tensor(b.positions), use_cache=False).logits.numpy()


def _ours(params, cfg, b):
    return np.asarray(forward(jax.tree.map(jnp.asarray, params), cfg, jnp.asarray(b.tokens), jnp.asarray(b.positions),
                              jnp.asarray(b.mask)))


@pytest.mark.parametrize("targets", [lora.ALL_TARGETS, ("q_proj", "v_proj")], ids=["all", "qv"])
def test_hf_parity_peft_loads_our_adapter_and_gives_our_logits(base, batch, tmp_path, targets):
    cfg, tree = _trained(base, targets)
    write_adapter(tmp_path / "adapter", cfg, tree, base_model=str(base.path))
    model = peft.PeftModel.from_pretrained(base.cls.from_pretrained(base.path), tmp_path / "adapter").eval()
    real = batch.mask == 1
    ref = _hf_logits(model, batch)
    ours = _ours(tree, cfg, batch)
    assert np.abs(ours - _ours(base.params, base.cfg, batch))[real].max() > 1e-2  # the adapter matters
    np.testing.assert_allclose(ours[real], ref[real], atol=1e-4, rtol=0)
    # peft's merge equals ours (what the merged HF export writes)
    theirs = {k: v.detach().numpy() for k, v in model.merge_and_unload().state_dict().items()}
    ours_merged = lora.merge_lora(tree, cfg)
    for t in lora.targets(cfg):
        ins = int(np.prod(lora._weight_shape(cfg, t)[1:1 + t.n_in]))
        for i in range(cfg.num_layers):
            got = ours_merged["layers"][t.group][t.weight][i].reshape(ins, -1).T  # HF's [out, in]
            np.testing.assert_allclose(got, theirs[f"model.layers.{i}.{t.hf_module}.weight"], atol=1e-6, rtol=0,
                                       err_msg=t.hf)


def test_hf_parity_an_adapter_peft_wrote_loads_into_ours(base, batch, tmp_path):
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(lora.ALL_TARGETS), lora_dropout=0.0,
                             init_lora_weights=False)  # random B: the adapter changes the logits
    torch.manual_seed(3)
    model = peft.get_peft_model(base.cls.from_pretrained(base.path), config).eval()
    model.save_pretrained(tmp_path / "theirs")
    cfg = dataclasses.replace(base.cfg, lora_rank=4, lora_alpha=8.0)
    adapters = read_adapter(tmp_path / "theirs", cfg)
    tree = lora.with_adapters(base.params, cfg)
    for g in tree["layers"].values():
        for k in g:
            if lora.is_adapter((k,)):
                g[k] = adapters[k]
    real = batch.mask == 1
    np.testing.assert_allclose(_ours(tree, cfg, batch)[real], _hf_logits(model, batch)[real], atol=1e-4, rtol=0)
