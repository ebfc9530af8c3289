"""HFCheckpoint, the streaming safetensors reader, against whole loads and the parameters that were saved:
every shard a layout asks for, dtypes, sharded checkpoints, the bytes each read touches, damaged files.

No torch: checkpoints are written by ``save_hf`` from random parameters of ``init_params``' shapes.
Run: ``python -m pytest tests/models/test_hf_reader.py -q``.
"""

import dataclasses
import json
import shutil
import struct
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from nereus_jax.config import ModelConfig
from nereus_jax.models import abstract_params, init_params, param_axes
from nereus_jax.models.hf import HFCheckpoint, HFImportError, load_hf, save_hf
from nereus_jax.sharding import Layout, kv_repeat, make_mesh, param_shardings, stored_shapes

# 4 layers (pp=2 gives 2 per stage), 4 heads, 2 kv heads (tp=4 stores each kv head twice).
CHECKPOINTS = {
    "llama_qkv_bias": (ModelConfig(family="llama", num_layers=4, qkv_bias=True), "lm", 1),
    "qwen2_tied": (ModelConfig(family="qwen2", num_layers=4, qkv_bias=True, tie_embeddings=True), "lm", 1),
    "qwen3": (ModelConfig(family="qwen3", num_layers=4, qk_norm=True, head_dim=32, rms_norm_eps=1e-6), "lm", 1),
    "qwen3_cls": (ModelConfig(family="qwen3", num_layers=4, qk_norm=True, head_dim=32, tie_embeddings=True), "value",
                  2),
}
LAYOUTS = [Layout(tp=2), Layout(tp=4), Layout(pp=2), Layout(tp=2, pp=2), Layout(tp=4, pp=2)]


def _flatten(tree, prefix=()):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _flatten(value, prefix + (key,))
        else:
            yield prefix + (key,), value


def _at(tree, path):
    for key in path:
        tree = tree[key]
    return tree


def _random_params(cfg, head, labels, seed=0):
    """Every value random (init_params' norms are ones and biases zeros, which would hide a mapping bug)."""
    rng = np.random.RandomState(seed)
    return jax.tree.map(lambda x: rng.standard_normal(x.shape).astype(np.float32),
                        init_params(cfg, seed=seed, head=head, num_labels=labels))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """name -> (directory, cfg, params) for each checkpoint, written once."""
    out = {}
    for seed, (name, (cfg, head, labels)) in enumerate(CHECKPOINTS.items()):
        params = _random_params(cfg, head, labels, seed)
        path = save_hf(tmp_path_factory.mktemp(name), cfg, params)
        out[name] = (path, cfg, params)
    return out


def _file_tensor_bytes(path: Path) -> int:
    """The tensors' total bytes, read by safetensors itself."""
    total = 0
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, framework="np") as f:
            total += sum(f.get_tensor(k).nbytes for k in f.keys())  # noqa: SIM118
    return total


def _layout_reads(cfg, head, labels, layout, devices):
    """(param path, the index a device of ``layout`` holds in the stored tree, kv-head axis or None, copies)."""
    mesh = make_mesh(devices[:layout.size], layout)
    shardings = param_shardings(cfg, layout, mesh, kind="train", head=head, num_labels=labels)
    stored = stored_shapes(cfg, layout, head=head, num_labels=labels)
    axes = param_axes(cfg, head=head, num_labels=labels)
    for path, sharding in _flatten(shardings):
        names = _at(axes, path)
        kv_axis = names.index("kv_heads") if "kv_heads" in names else None
        for index in sharding.devices_indices_map(_at(stored, path)).values():
            yield path, index, kv_axis, kv_repeat(cfg, layout)


def _read_stored(ckpt, path, index, kv_axis, rep):
    """A stored-tree shard through the reader: kv heads a layout repeats map back to the canonical head."""
    if kv_axis is None or rep == 1:
        return ckpt.read(path, index, dtype="float32")
    s = index[kv_axis]
    a, b, _ = s.indices(_at(ckpt.shapes(), path)[kv_axis] * rep)
    canonical = list(index)
    canonical[kv_axis] = slice(a // rep, (b - 1) // rep + 1)
    x = np.repeat(ckpt.read(path, tuple(canonical), dtype="float32"), rep, axis=kv_axis)
    keep = [slice(None)] * x.ndim
    keep[kv_axis] = slice(a - (a // rep) * rep, a - (a // rep) * rep + (b - a))
    return x[tuple(keep)]


# ------------------------------------------------------------------------------------------- values
@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_load_hf_returns_the_saved_parameters_and_shapes_match_abstract_params(saved, name):
    path, cfg, params = saved[name]
    loaded_cfg, loaded = load_hf(path)
    assert dataclasses.replace(loaded_cfg, name=cfg.name) == cfg
    jax.tree.map(np.testing.assert_array_equal, loaded, params)
    _, head, labels = CHECKPOINTS[name]
    ckpt = HFCheckpoint(path)
    assert (ckpt.head, ckpt.num_labels, ckpt.dtype) == (head, labels, "float32")
    assert ckpt.shapes() == jax.tree.map(lambda s: s.shape, abstract_params(cfg, head=head, num_labels=labels))


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_every_shard_a_layout_asks_for_equals_that_slice_of_the_full_load(saved, devices, name, layout):
    path, cfg, _ = saved[name]
    _, head, labels = CHECKPOINTS[name]
    _, full = load_hf(path)
    ckpt = HFCheckpoint(path)
    expanded = {}
    reads = 0
    for param, index, kv_axis, rep in _layout_reads(cfg, head, labels, layout, devices):
        if param not in expanded:
            whole = _at(full, param)
            expanded[param] = whole if kv_axis is None else np.repeat(whole, rep, axis=kv_axis)
        got = _read_stored(ckpt, param, index, kv_axis, rep)
        np.testing.assert_array_equal(got, expanded[param][index], err_msg=f"{param} {index}")
        reads += 1
    assert reads == layout.size * len(list(_flatten(full)))


def test_whole_read_without_dtype_keeps_the_checkpoint_dtype_and_equals_load_hf(saved):
    path, _, _ = saved["qwen3"]
    _, full = load_hf(path, dtype="float32")
    ckpt = HFCheckpoint(path)
    for param, value in _flatten(full):
        x = ckpt.read(param)
        assert x.dtype == np.float32 and x.shape == value.shape
        np.testing.assert_array_equal(x, value)


def test_bf16_checkpoint_read_as_float32_equals_the_bf16_values_cast(saved, tmp_path):
    path, cfg, params = saved["qwen3"]
    save_hf(tmp_path, cfg, params, dtype="bfloat16")
    ckpt = HFCheckpoint(tmp_path)
    assert ckpt.dtype == "bfloat16" and json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    index = (slice(1, 3), slice(None), slice(2, 4))
    for param, value in _flatten(params):
        as_bf16 = value.astype(ml_dtypes.bfloat16)
        own = ckpt.read(param)
        assert own.dtype == ml_dtypes.bfloat16
        np.testing.assert_array_equal(own, as_bf16)
        np.testing.assert_array_equal(ckpt.read(param, dtype="float32"), as_bf16.astype(np.float32))
    wq = ("layers", "attn", "wq")
    np.testing.assert_array_equal(ckpt.read(wq, index, dtype=np.float32),
                                  params["layers"]["attn"]["wq"][index].astype(ml_dtypes.bfloat16).astype(np.float32))
    _, as_f32 = load_hf(tmp_path)  # cfg.param_dtype
    assert as_f32["embed"]["embedding"].dtype == np.float32


def test_sharded_checkpoint_reads_the_same_as_one_file(saved, devices, tmp_path):
    path, cfg, params = saved["llama_qkv_bias"]
    save_hf(tmp_path, cfg, params, max_shard_bytes=40_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2 and not (tmp_path / "model.safetensors").exists()
    assert index["metadata"]["total_size"] == _file_tensor_bytes(tmp_path) == _file_tensor_bytes(path)
    one, many = HFCheckpoint(path), HFCheckpoint(tmp_path)
    for param, index, kv_axis, rep in _layout_reads(cfg, "lm", 1, Layout(tp=2, pp=2), devices):
        np.testing.assert_array_equal(_read_stored(many, param, index, kv_axis, rep),
                                      _read_stored(one, param, index, kv_axis, rep))
    _, loaded = load_hf(tmp_path)
    jax.tree.map(np.testing.assert_array_equal, loaded, params)


def test_tensors_larger_than_a_transpose_block_convert_exactly(tmp_path):
    """Every matrix here spans several of the reader's cache-sized transpose blocks (128 KiB)."""
    cfg = ModelConfig(family="llama", num_layers=1, vocab_size=4096, hidden_size=1024, intermediate_size=2048)
    params = _random_params(cfg, "lm", 1, seed=5)
    save_hf(tmp_path, cfg, params, dtype="bfloat16")
    ckpt = HFCheckpoint(tmp_path)
    for param in [("lm_head", "kernel"), ("layers", "attn", "wq"), ("layers", "attn", "wk"), ("layers", "attn", "wo"),
                  ("layers", "mlp", "w_gate"), ("layers", "mlp", "w_down")]:
        want = _at(params, param).astype(ml_dtypes.bfloat16)
        np.testing.assert_array_equal(ckpt.read(param), want)
        index = tuple(slice(n // 4, n // 2) for n in want.shape)
        np.testing.assert_array_equal(ckpt.read(param, index, dtype="float32"), want[index].astype(np.float32))


# -------------------------------------------------------------------------------------- bytes read
@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_reading_the_whole_model_once_reads_every_tensor_byte_once(saved, name):
    """Opening reads headers only; then every parameter once touches each tensor once (Llama's zero o_proj
    biases included: reading wo checks them)."""
    path, _, params = saved[name]
    ckpt = HFCheckpoint(path)
    assert ckpt.bytes_read == 0
    for param, _ in _flatten(params):
        ckpt.read(param)
    assert ckpt.bytes_read == _file_tensor_bytes(path)


def test_a_tp2_shard_of_wq_reads_half_of_its_bytes(saved, devices):
    path, cfg, params = saved["qwen3"]
    ckpt = HFCheckpoint(path)
    sharding = param_shardings(cfg, Layout(tp=2), make_mesh(devices[:2], Layout(tp=2)))["layers"]["attn"]["wq"]
    wq = params["layers"]["attn"]["wq"]
    index = sharding.devices_indices_map(wq.shape)[devices[1]]
    assert index[2] == slice(2, 4)
    ckpt.read(("layers", "attn", "wq"), index)
    assert ckpt.bytes_read == wq.nbytes // 2


@pytest.mark.parametrize("param, axis", [(("layers", "attn", "wo"), 1), (("layers", "mlp", "w_down"), 1)])
def test_column_split_tensors_read_only_their_row_segments_when_holes_are_not_merged(saved, param, axis):
    """o_proj [D, heads*E] and down_proj [D, F] split on columns: one pread per row segment reads exactly the
    shard; with the default hole limit the tiny rows' segments merge into spans (more bytes, fewer reads)."""
    path, _, params = saved["qwen3"]
    full = _at(params, param)
    index = [slice(None)] * full.ndim
    index[axis] = slice(full.shape[axis] // 2, full.shape[axis])
    exact = HFCheckpoint(path, max_hole_bytes=0)
    np.testing.assert_array_equal(exact.read(param, tuple(index)), full[tuple(index)])
    assert exact.bytes_read == full.nbytes // 2
    merged = HFCheckpoint(path)
    np.testing.assert_array_equal(merged.read(param, tuple(index)), full[tuple(index)])
    assert full.nbytes // 2 < merged.bytes_read < full.nbytes


def test_a_pipeline_stage_reads_only_its_layers(saved):
    path, _, params = saved["qwen3"]
    ckpt = HFCheckpoint(path)
    w_up = params["layers"]["mlp"]["w_up"]
    np.testing.assert_array_equal(ckpt.read(("layers", "mlp", "w_up"), (slice(2, 4),)), w_up[2:4])
    assert ckpt.bytes_read == w_up.nbytes // 2


# ------------------------------------------------------------------------------------------ errors
def _copy(saved, name, dst: Path) -> Path:
    return Path(shutil.copytree(saved[name][0], dst))


def test_truncated_file_raises_naming_the_file(saved, tmp_path):
    path = _copy(saved, "qwen3", tmp_path / "ckpt")
    file = path / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[:-10])
    with pytest.raises(HFImportError, match=rf"{file}.*truncated"):
        HFCheckpoint(path)
    file.write_bytes(data[:100])  # shorter than its header
    with pytest.raises(HFImportError, match=rf"{file}.*truncated"):
        HFCheckpoint(path)
    file.write_bytes(b"")
    with pytest.raises(HFImportError, match=rf"{file}.*empty"):
        load_hf(path)


def test_missing_shard_raises_naming_the_file(saved, tmp_path):
    path, cfg, params = saved["qwen3"]
    save_hf(tmp_path, cfg, params, max_shard_bytes=40_000)
    weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    shard = tmp_path / sorted(set(weight_map.values()))[1]
    shard.unlink()
    with pytest.raises(HFImportError, match=rf"{shard}.*missing"):
        HFCheckpoint(tmp_path)


def test_header_that_is_not_json_raises_naming_the_file(saved, tmp_path):
    path = _copy(saved, "qwen3", tmp_path / "ckpt")
    file = path / "model.safetensors"
    data = bytearray(file.read_bytes())
    data[8:20] = b"not json {[ "
    file.write_bytes(bytes(data))
    with pytest.raises(HFImportError, match=rf"{file}.*not valid JSON"):
        HFCheckpoint(path)


def test_tensor_listed_twice_raises_naming_the_files(saved, tmp_path):
    path = _copy(saved, "qwen3", tmp_path / "ckpt")
    (path / "model.safetensors").rename(path / "a.safetensors")
    save_file({"model.norm.weight": np.ones(64, np.float32)}, path / "b.safetensors")
    with pytest.raises(HFImportError, match=r"model\.norm\.weight.*a\.safetensors.*b\.safetensors"):
        HFCheckpoint(path)
    header = b'{"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, ' \
             b'"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}'
    (path / "b.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 4)
    with pytest.raises(HFImportError, match=r"b\.safetensors.*'x' twice"):
        HFCheckpoint(path)


def test_wrong_shape_and_missing_tensor_are_named_when_opening(saved, tmp_path):
    path = _copy(saved, "qwen3", tmp_path / "ckpt")
    with safe_open(path / "model.safetensors", framework="np") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    name = "model.layers.1.self_attn.k_norm.weight"
    save_file({**tensors, name: np.ones(16, np.float32)}, path / "model.safetensors")
    with pytest.raises(HFImportError, match=rf"{name}.*model\.safetensors.*\(16,\).*\(32,\)"):
        HFCheckpoint(path)
    del tensors[name]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(HFImportError, match=rf"{name}.*missing"):
        HFCheckpoint(path)


def test_nonzero_o_proj_bias_is_refused_when_wo_is_read(saved, tmp_path):
    path = _copy(saved, "llama_qkv_bias", tmp_path / "ckpt")
    with safe_open(path / "model.safetensors", framework="np") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    name = "model.layers.3.self_attn.o_proj.bias"
    save_file({**tensors, name: np.ones(64, np.float32)}, path / "model.safetensors")
    ckpt = HFCheckpoint(path)
    ckpt.read(("layers", "attn", "wo"), (slice(0, 2),))  # layers 0-1: zero biases
    with pytest.raises(HFImportError, match=name):
        ckpt.read(("layers", "attn", "wo"), (slice(2, 4),))


def test_reads_reject_strided_slices_and_unknown_parameters(saved):
    ckpt = HFCheckpoint(saved["qwen3"][0])
    with pytest.raises(ValueError, match="step 1"):
        ckpt.read(("layers", "attn", "wq"), (slice(0, 4, 2),))
    with pytest.raises(KeyError, match="lm_head"):
        ckpt.read(("layers", "attn", "bq"))


def test_save_hf_refuses_a_tree_with_a_layouts_kv_copies(saved, tmp_path):
    _, cfg, params = saved["qwen3"]
    attn = {**params["layers"]["attn"], "wk": np.repeat(params["layers"]["attn"]["wk"], 2, axis=2)}
    copies = {**params, "layers": {**params["layers"], "attn": attn}}
    with pytest.raises(ValueError, match="layers/attn/wk.*gather_params"):
        save_hf(tmp_path, cfg, copies)
