"""Hugging Face import and export: Llama / Qwen2 / Qwen3 checkpoints (config.json + safetensors) <-> our tree.

Host numpy only: local directories (no hub access), no torch, no transformers, no meshes. Supported:
``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM`` (language-model head) and their
``*ForSequenceClassification`` (the ``score`` layer becomes our value head); the config.json translation
lives in :mod:`nereus_jax.hf_config`. Anything else raises :class:`HFImportError` naming the file, key or
tensor and what is supported.

:class:`HFCheckpoint` opens a checkpoint by parsing its safetensors headers only, and ``read`` returns any
slice of one of OUR parameters, converted from the HF tensors with ``os.pread`` of just the bytes the slice
needs: a device loads its shard of a model without reading (or holding) the rest. :func:`load_hf` is a whole
read of every parameter through the same path.

Usage::

    from nereus_jax.models.hf import HFCheckpoint, load_hf, save_hf
    cfg, params = load_hf("/models/Qwen3-0.6B")                   # numpy tree in cfg.param_dtype
    cfg, params = load_hf(path, dtype="bfloat16")                 # cast on the way in
    params = sharding.shard_params(params, cfg, layout, mesh)     # laid out (models/ never imports sharding)
    ckpt = HFCheckpoint(path)                                     # headers only
    wq_shard = ckpt.read(("layers", "attn", "wq"), (slice(0, 14), slice(None), slice(0, 8)), dtype="float32")
    jax.make_array_from_callback(shape, sharding, lambda idx: ckpt.read(param_path, idx, dtype="bfloat16"))
    # (a layout's repeated kv heads map back to canonical ones: nereus_jax.elastic.sources.read_stored)
    save_hf("/tmp/export", cfg, sharding.gather_params(params, cfg))   # from_pretrained loads it
    save_hf(out, cfg, critic_params, dtype="bfloat16", extra_config={"pad_token_id": 0}, max_shard_bytes=2**30)

Parity with transformers: ``.venv311/bin/python -m pytest tests/models/test_hf_parity.py -q``; the reader:
``python -m pytest tests/models/test_hf_reader.py -q``.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from nereus_jax._typed_tree import from_dict
from nereus_jax.config import ConfigError, ModelConfig
from nereus_jax.hf_config import (
    HEAD_SUFFIX,
    HFImportError,
    family_and_head,
    hf_config_from_model,
    model_keys_from_hf,
    read_hf_config,
)

__all__ = ["HFCheckpoint", "HFImportError", "hf_config_from_model", "load_hf", "model_config_from_hf", "save_hf"]

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # transformers' "5GB" shards
# Column-segment reads (o_proj and down_proj split on their columns): two segments closer than this are read
# as one span, gap included, since one more request costs about as much as reading this many bytes (Arrow's
# ReadRangeCache uses the same 8 KiB hole limit). Farther apart: one pread per row segment.
DEFAULT_MAX_HOLE_BYTES = 8192
# A transposing copy goes in blocks of the source's leading axis of about this size, which stay in cache;
# one strided copy of a large transpose misses it on nearly every element.
_TRANSPOSE_BLOCK_BYTES = 128 * 1024
_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
           "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2, "I64": np.int64, "I32": np.int32,
           "I16": np.int16, "I8": np.int8, "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8,
           "BOOL": np.bool_}


def model_config_from_hf(hf_config: Mapping[str, Any], name: str = "hf") -> ModelConfig:
    """A ModelConfig from a Hugging Face ``config.json`` dict (transformers 4.x or 5.x format)."""
    keys = model_keys_from_hf(hf_config)
    try:
        return from_dict(ModelConfig, {"name": name, **keys}, "model")
    except ConfigError as e:
        raise HFImportError(f"config.json describes a model nereus_jax cannot build: {e}") from None


# ------------------------------------------------------------------------------------------ tensor table
@dataclass(frozen=True)
class _Rule:
    """One parameter: our path, the HF tensor (``{i}`` = layer) and its shape, and how the axes relate: the
    HF tensor reshaped to ``view`` (its axes split, same bytes) and transposed by ``perm`` is our parameter
    (one layer of it, for a per-layer parameter)."""

    ours: tuple[str, ...]
    hf: str
    hf_shape: Callable[[ModelConfig, int], tuple[int, ...]]
    view: Callable[[ModelConfig, int], tuple[int, ...]]
    perm: tuple[int, ...]

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.hf

    @property
    def per_expert(self) -> bool:
        """One HF tensor per layer and expert (``{e}``): ours stacks them as [layers, experts, ...]."""
        return "{e}" in self.hf

    def our_shape(self, cfg: ModelConfig, num_labels: int) -> tuple[int, ...]:
        view = self.view(cfg, num_labels)
        layer = tuple(view[p] for p in self.perm)
        if self.per_expert:
            return (cfg.num_layers, cfg.num_experts, *layer)
        return (cfg.num_layers, *layer) if self.per_layer else layer

    def names(self, cfg: ModelConfig, layers=None, experts=None) -> list[tuple[tuple[int, ...], str]]:
        """(index into our stacked parameter, HF tensor name) of every HF tensor (within ``layers`` /
        ``experts`` ranges when given)."""
        if not self.per_layer:
            return [((), self.hf)]
        layers = range(cfg.num_layers) if layers is None else layers
        if not self.per_expert:
            return [((j,), self.hf.format(i=i)) for j, i in enumerate(layers)]
        experts = range(cfg.num_experts) if experts is None else experts
        return [((j, k), self.hf.format(i=i, e=e)) for j, i in enumerate(layers) for k, e in enumerate(experts)]

    def to_hf(self, x: np.ndarray, cfg: ModelConfig, num_labels: int) -> np.ndarray:
        """One layer of our parameter as the HF tensor."""
        out = np.empty(self.view(cfg, num_labels), x.dtype)
        _copy_transposed(out, x, tuple(int(p) for p in np.argsort(self.perm)))
        return out.reshape(self.hf_shape(cfg, num_labels))


def _rule(ours: tuple[str, ...], hf: str, hf_shape: Callable, perm: tuple[int, ...],
          view: Callable | None = None) -> _Rule:
    return _Rule(ours, hf, hf_shape, view or hf_shape, perm)


def _proj_rule(name: str, heads: Callable[[ModelConfig], int]) -> _Rule:
    """q/k/v_proj.weight [heads*E, D] viewed [heads, E, D] -> w [D, heads, E]."""
    return _rule(("layers", "attn", f"w{name}"), f"model.layers.{{i}}.self_attn.{name}_proj.weight",
                 lambda c, n: (heads(c) * c.head_dim, c.hidden_size), (2, 0, 1),
                 lambda c, n: (heads(c), c.head_dim, c.hidden_size))


def _bias_rule(name: str, heads: Callable[[ModelConfig], int]) -> _Rule:
    """q/k/v_proj.bias [heads*E] -> b [heads, E]."""
    return _rule(("layers", "attn", f"b{name}"), f"model.layers.{{i}}.self_attn.{name}_proj.bias",
                 lambda c, n: (heads(c) * c.head_dim,), (0, 1), lambda c, n: (heads(c), c.head_dim))


def _rules(cfg: ModelConfig, head: str) -> list[_Rule]:
    """Every parameter of a model with ``cfg`` and ``head``, in HF's order."""
    q_heads, kv_heads = (lambda c: c.num_heads), (lambda c: c.num_kv_heads)
    vector, head_vector = (lambda c, n: (c.hidden_size,)), (lambda c, n: (c.head_dim,))
    layer = "model.layers.{i}."
    rules = [
        _rule(("embed", "embedding"), "model.embed_tokens.weight", lambda c, n: (c.vocab_size, c.hidden_size),
              (0, 1)),
        _rule(("layers", "attn_norm", "scale"), layer + "input_layernorm.weight", vector, (0,)),
        _proj_rule("q", q_heads), _proj_rule("k", kv_heads), _proj_rule("v", kv_heads),
        _rule(("layers", "attn", "wo"), layer + "self_attn.o_proj.weight",
              lambda c, n: (c.hidden_size, c.num_heads * c.head_dim), (1, 2, 0),
              lambda c, n: (c.hidden_size, c.num_heads, c.head_dim)),
        _rule(("layers", "mlp_norm", "scale"), layer + "post_attention_layernorm.weight", vector, (0,)),
        *(_moe_rules() if cfg.num_experts else _mlp_rules()),
        _rule(("final_norm", "scale"), "model.norm.weight", vector, (0,)),
    ]
    if cfg.qkv_bias:
        rules += [_bias_rule("q", q_heads), _bias_rule("k", kv_heads), _bias_rule("v", kv_heads)]
    if cfg.qk_norm:
        rules += [_rule(("layers", "attn", f"{w}_norm", "scale"), layer + f"self_attn.{w}_norm.weight", head_vector,
                        (0,))
                  for w in ("q", "k")]
    if head == "value":
        rules.append(_rule(("value_head", "kernel"), "score.weight", lambda c, n: (n, c.hidden_size), (1, 0)))
    elif not cfg.tie_embeddings:
        rules.append(_rule(("lm_head", "kernel"), "lm_head.weight", lambda c, n: (c.vocab_size, c.hidden_size),
                           (1, 0)))
    return rules


def _swiglu_rules(group: str, prefix: str, width: Callable[[ModelConfig], int]) -> list[_Rule]:
    """A SwiGLU MLP's three projections under ``prefix`` (``gate_proj`` / ``up_proj`` [width, embed],
    ``down_proj`` [embed, width]) as our ``layers/<group>/w_{gate,up,down}``."""
    return [
        _rule(("layers", group, "w_gate"), prefix + "gate_proj.weight", lambda c, n: (width(c), c.hidden_size), (1, 0)),
        _rule(("layers", group, "w_up"), prefix + "up_proj.weight", lambda c, n: (width(c), c.hidden_size), (1, 0)),
        _rule(("layers", group, "w_down"), prefix + "down_proj.weight", lambda c, n: (c.hidden_size, width(c)), (1, 0)),
    ]


def _mlp_rules() -> list[_Rule]:
    return _swiglu_rules("mlp", "model.layers.{i}.mlp.", lambda c: c.intermediate_size)


def _moe_rules() -> list[_Rule]:
    """Qwen3-MoE: the router (``mlp.gate`` [experts, embed]) and each expert's SwiGLU, one tensor per expert."""
    return [
        _rule(("layers", "moe", "router"), "model.layers.{i}.mlp.gate.weight",
              lambda c, n: (c.num_experts, c.hidden_size), (1, 0)),
        *_swiglu_rules("moe", "model.layers.{i}.mlp.experts.{e}.", lambda c: c.moe_intermediate_size),
    ]


def _has_o_bias(cfg: ModelConfig) -> bool:
    """HF Llama's and Qwen3's attention_bias also biases o_proj, which our decoder lacks."""
    return cfg.qkv_bias and cfg.family in ("llama", "qwen3", "qwen3_moe")


def _o_bias_name(i: int) -> str:
    return f"model.layers.{i}.self_attn.o_proj.bias"


# ------------------------------------------------------------------------------------- safetensors headers
@dataclass(frozen=True)
class _Tensor:
    """Where one tensor's bytes lie: ``nbytes`` from absolute offset ``start`` of ``file``."""

    file: Path
    dtype: np.dtype
    shape: tuple[int, ...]
    start: int
    nbytes: int


def _no_duplicate_keys(file: Path) -> Callable:
    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise HFImportError(f"{file}: the safetensors header lists tensor {key!r} twice")
            out[key] = value
        return out

    return hook


def _read_header(file: Path) -> dict[str, _Tensor]:
    """The tensors of one safetensors file (8-byte little-endian header length, then a JSON header of dtype,
    shape and data_offsets relative to the end of the header); checks the file holds every byte it lists."""
    size = file.stat().st_size
    if size < 8:
        raise HFImportError(f"{file} is truncated or empty ({size} bytes): a safetensors file starts with an "
                            "8-byte header length")
    with open(file, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        if size < 8 + header_len:
            raise HFImportError(f"{file} is truncated: its header claims {header_len} bytes, the file has {size}")
        raw = f.read(header_len)
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicate_keys(file))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HFImportError(f"{file}: the safetensors header is not valid JSON ({e}); the file is damaged") from None
    if not isinstance(header, dict):
        raise HFImportError(f"{file}: the safetensors header is not a JSON object")
    header.pop("__metadata__", None)
    tensors = {name: _tensor_entry(file, name, entry, 8 + header_len) for name, entry in header.items()}
    end = max((t.start + t.nbytes for t in tensors.values()), default=8 + header_len)
    if size < end:
        raise HFImportError(f"{file} is truncated: its header places tensor data up to byte {end}, the file has "
                            f"{size}")
    return tensors


def _tensor_entry(file: Path, name: str, entry: Any, base: int) -> _Tensor:
    try:
        dtype, shape, (begin, end) = entry["dtype"], tuple(int(s) for s in entry["shape"]), entry["data_offsets"]
    except (TypeError, KeyError, ValueError):
        raise HFImportError(f"{file}: header entry of tensor {name!r} lacks dtype, shape or data_offsets") from None
    if dtype not in _DTYPES:
        raise HFImportError(f"{file}: tensor {name!r} has dtype {dtype!r}; supported: {sorted(_DTYPES)}")
    np_dtype = np.dtype(_DTYPES[dtype])
    if not (isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end):
        raise HFImportError(f"{file}: tensor {name!r} has data_offsets {[begin, end]}")
    if end - begin != math.prod(shape) * np_dtype.itemsize:
        raise HFImportError(f"{file}: tensor {name!r} ({dtype}, shape {shape}) needs "
                            f"{math.prod(shape) * np_dtype.itemsize} bytes, its data_offsets span {end - begin}")
    return _Tensor(file, np_dtype, shape, base + begin, end - begin)


def _checkpoint_tensors(path: Path) -> dict[str, _Tensor]:
    """Every tensor of a checkpoint directory: the files ``model.safetensors.index.json`` lists, else
    ``model.safetensors``, else every ``*.safetensors``. A tensor in two files is an error."""
    out: dict[str, _Tensor] = {}
    weight_map = _weight_map(path)
    for file in _tensor_files(path, weight_map):
        for name, tensor in _read_header(file).items():
            if name in out:
                raise HFImportError(f"tensor {name!r} appears in both {out[name].file} and {file}")
            out[name] = tensor
    for name, file_name in (weight_map or {}).items():
        if name not in out or out[name].file.name != file_name:
            raise HFImportError(f"{path / _INDEX} maps tensor {name!r} to {path / file_name}, whose header lacks it")
    return out


def _weight_map(path: Path) -> dict[str, str] | None:
    index = path / _INDEX
    if not index.is_file():
        return None
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise HFImportError(f"{index} is not a safetensors index (JSON with a 'weight_map'): {e!r}") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise HFImportError(f"{index}: 'weight_map' must map tensor names to file names")
    return weight_map


def _tensor_files(path: Path, weight_map: Mapping[str, str] | None) -> list[Path]:
    if weight_map is not None:
        files = [path / name for name in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise HFImportError(f"{f} is missing: {path / _INDEX} lists it as a shard of the checkpoint")
        return files
    if (path / _SINGLE).is_file():
        return [path / _SINGLE]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise HFImportError(f"{path} has no *.safetensors files (nor {_INDEX}); only safetensors checkpoints load")
    return files


# ------------------------------------------------------------------------------------------------- reader
class HFCheckpoint:
    """A Hugging Face checkpoint directory opened for reading slices of our parameters.

    Opening parses config.json and the safetensors headers (no tensor data) and checks every tensor the
    model needs is there with the shape config.json implies. :meth:`read` then converts any box of one of
    our parameters, reading only the bytes it covers; it is thread-safe (``os.pread`` has no file
    position). ``bytes_read`` counts the tensor bytes read so far.
    """

    def __init__(self, path: str | Path, *, max_hole_bytes: int = DEFAULT_MAX_HOLE_BYTES):
        self.path = Path(path)
        hf = read_hf_config(self.path)
        self.config = model_config_from_hf(hf, name=self.path.resolve().name or "hf")
        _, self.head = family_and_head(hf)
        self.max_hole_bytes = max_hole_bytes
        self.bytes_read = 0
        self._lock = threading.Lock()
        self._tensors = _checkpoint_tensors(self.path)
        self.num_labels = self._num_labels(hf)
        self._rules = {rule.ours: rule for rule in _rules(self.config, self.head)}
        self._check_shapes()
        self.dtype = self._tensor("model.embed_tokens.weight").dtype.name
        self._o_bias_checked: set[int] = set()

    def shapes(self) -> dict:
        """Our canonical parameter tree of shape tuples (as ``abstract_params`` gives them)."""
        tree: dict = {}
        for path, rule in self._rules.items():
            _set(tree, path, rule.our_shape(self.config, self.num_labels))
        return tree

    def read(self, path: tuple[str, ...], index: tuple[slice, ...] | None = None, dtype=None) -> np.ndarray:
        """The box ``index`` (slices with step 1, trailing axes whole when omitted) of our parameter at
        ``path``, converted from the HF tensors, in ``dtype`` (a name or numpy dtype; default: the tensors'
        own). For a per-layer parameter only the layers in the box are read, and of each layer's tensor only
        the rows, or row segments, the box covers."""
        rule = self._rules.get(tuple(path))
        if rule is None:
            raise KeyError(f"{'/'.join(path)} is not a parameter of this checkpoint's model; parameters: "
                           f"{sorted('/'.join(p) for p in self._rules)}")
        box = _box(index, rule.our_shape(self.config, self.num_labels), path)
        lead = 2 if rule.per_expert else 1 if rule.per_layer else 0  # stacked axes: layers (, experts)
        inner = box[lead:]
        view_box = [inner[rule.perm.index(a)] for a in range(len(rule.perm))]  # our axis k is view axis perm[k]
        own_dtype = self._tensor(rule.names(self.config, [0], [0])[0][1]).dtype
        out = _aligned_empty(tuple(b - a for a, b in box), own_dtype if dtype is None else _np_dtype(dtype))
        layers = range(*box[0]) if rule.per_layer else None
        experts = range(*box[1]) if rule.per_expert else None
        with _Files() as files:
            for at, name in rule.names(self.config, layers, experts):
                part = self._read_box(files, self._tensor(name), rule.view(self.config, self.num_labels), view_box)
                _copy_transposed(out[at], part, rule.perm)
            if rule.ours == ("layers", "attn", "wo") and _has_o_bias(self.config):
                self._check_zero_o_bias(files, list(layers))
        return out

    def _read_box(self, files: _Files, t: _Tensor, view: tuple[int, ...], box: list[tuple[int, int]]) -> np.ndarray:
        """The box of tensor ``t`` seen as the row-major array ``view``: its contiguous runs (the box's last
        partial axis times the whole axes after it), one pread per run, except that runs closer than
        ``max_hole_bytes`` are read as one span and cut apart in memory."""
        item = t.dtype.itemsize
        shape = tuple(b - a for a, b in box)
        raw = np.empty(math.prod(shape) * item, np.uint8)
        if raw.size:
            starts, run = _runs(view, box)
            starts, run = starts * item + t.start, run * item
            pos = 0
            for group in _groups(starts, run, self.max_hole_bytes):
                span = int(group[-1] - group[0]) + run
                if len(group) == 1:
                    self._pread(files, t.file, raw[pos:pos + run], int(group[0]))
                else:
                    buf = np.empty(span, np.uint8)
                    self._pread(files, t.file, buf, int(group[0]))
                    windows = np.lib.stride_tricks.sliding_window_view(buf, run)
                    raw[pos:pos + len(group) * run].reshape(len(group), run)[:] = windows[group - group[0]]
                pos += len(group) * run
        return raw.view(t.dtype).reshape(shape)

    def _pread(self, files: _Files, file: Path, out: np.ndarray, offset: int) -> None:
        view, fd, done = memoryview(out), files.fd(file), 0
        while done < len(view):
            n = _pread_into(fd, view[done:], offset + done)
            if n == 0:
                raise HFImportError(f"{file} ended at byte {offset + done} while reading tensor data: it was "
                                    "truncated after the checkpoint was opened")
            done += n
        with self._lock:
            self.bytes_read += done

    def _tensor(self, name: str) -> _Tensor:
        try:
            return self._tensors[name]
        except KeyError:
            raise HFImportError(f"tensor {name!r} is missing from the checkpoint {self.path}") from None

    def _num_labels(self, hf: Mapping[str, Any]) -> int:
        if self.head != "value":
            return 1
        score = self._tensor("score.weight")
        n = score.shape[0]
        expected = len(hf["id2label"]) if hf.get("id2label") else hf.get("num_labels", n)
        if n != expected:
            raise HFImportError(f"tensor 'score.weight' in {score.file} has {n} rows but config.json declares "
                                f"{expected} labels")
        return n

    def _check_shapes(self) -> None:
        for rule in self._rules.values():
            expected = rule.hf_shape(self.config, self.num_labels)
            for _, name in rule.names(self.config):
                t = self._tensor(name)
                if t.shape != expected:
                    raise HFImportError(f"tensor {name!r} in {t.file} has shape {t.shape}, expected {expected} "
                                        "from config.json")

    def _check_zero_o_bias(self, files: _Files, layers: list[int]) -> None:
        """Accepts an o_proj bias (HF attention_bias) only when zero: our decoder has none."""
        for i in layers:
            t = self._tensors.get(_o_bias_name(i))
            if t is None or i in self._o_bias_checked:
                continue
            bias = self._read_box(files, t, t.shape, [(0, n) for n in t.shape])
            if np.any(bias != 0):
                raise HFImportError(f"tensor {_o_bias_name(i)!r} in {t.file} is non-zero; supported: "
                                    "attention_bias with a zero o_proj bias (nereus_jax has no output-projection bias)")
            self._o_bias_checked.add(i)


class _Files:
    """File descriptors opened on first use within one read, closed at its end."""

    def __init__(self):
        self._fds: dict[Path, int] = {}

    def fd(self, file: Path) -> int:
        if file not in self._fds:
            self._fds[file] = os.open(file, os.O_RDONLY | getattr(os, "O_BINARY", 0))
        return self._fds[file]

    def __enter__(self) -> _Files:
        return self

    def __exit__(self, *exc) -> None:
        for fd in self._fds.values():
            os.close(fd)


def _pread_into(fd: int, out: memoryview, offset: int) -> int:
    """One pread straight into ``out`` (``os.preadv``), or through a bytes copy where that is missing."""
    if hasattr(os, "preadv"):
        return os.preadv(fd, [out], offset)
    chunk = os.pread(fd, len(out), offset)
    out[:len(chunk)] = chunk
    return len(chunk)


def _aligned_empty(shape: tuple[int, ...], dtype, alignment: int = 64) -> np.ndarray:
    """``np.empty`` on a 64-byte boundary: JAX's CPU backend adopts such a host buffer as a device buffer
    without copying it (an unaligned one is copied), so a shard read for a CPU device is not held twice."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + alignment, np.uint8)
    offset = (-raw.ctypes.data) % alignment
    return raw[offset:offset + nbytes].view(dtype).reshape(shape)


def _copy_transposed(out: np.ndarray, part: np.ndarray, perm: tuple[int, ...]) -> None:
    """``out[...] = part.transpose(perm)`` cast to ``out.dtype``: the cast first (a contiguous pass; ml_dtypes
    casts element by element inside a strided copy), then the transpose in cache-sized blocks."""
    if perm == tuple(range(len(perm))) or part.size == 0:
        np.copyto(out, part, casting="unsafe")  # cast straight into out: no whole cast copy of the part
        return
    axis = perm.index(0)
    step = max(1, _TRANSPOSE_BLOCK_BYTES // max(1, part[0].astype(out.dtype, copy=False).nbytes))
    for start in range(0, part.shape[0], step):
        index = [slice(None)] * out.ndim
        index[axis] = slice(start, start + step)
        out[tuple(index)] = part[start:start + step].astype(out.dtype, copy=False).transpose(perm)


def _box(index: tuple[slice, ...] | None, shape: tuple[int, ...], path) -> list[tuple[int, int]]:
    index = () if index is None else tuple(index)
    if len(index) > len(shape):
        raise ValueError(f"index {index} has more axes than parameter {'/'.join(path)} of shape {shape}")
    box = []
    for n, s in zip(shape, index + (slice(None),) * (len(shape) - len(index)), strict=True):
        if not isinstance(s, slice):
            raise TypeError(f"index of {'/'.join(path)}: expected slices, got {s!r}")
        start, stop, step = s.indices(n)
        if step != 1:
            raise ValueError(f"index of {'/'.join(path)}: only step 1 slices are read, got {s!r}")
        box.append((start, max(start, stop)))
    return box


def _runs(shape: tuple[int, ...], box: list[tuple[int, int]]) -> tuple[np.ndarray, int]:
    """Element offsets (in order) and common length of the contiguous runs that make up ``box`` of a
    row-major array of ``shape``: axes after the last partially covered one join each run."""
    strides = [math.prod(shape[j + 1:]) for j in range(len(shape))]
    k = len(shape) - 1
    while k > 0 and box[k] == (0, shape[k]):
        k -= 1
    starts = np.asarray(box[k][0] * strides[k], np.int64)
    for j in range(k - 1, -1, -1):
        starts = (np.arange(*box[j], dtype=np.int64) * strides[j]).reshape((-1,) + (1,) * starts.ndim) + starts
    return starts.reshape(-1), (box[k][1] - box[k][0]) * strides[k]


def _groups(starts: np.ndarray, run: int, max_hole: int) -> Iterator[np.ndarray]:
    """Runs split where the hole to the next run exceeds ``max_hole`` bytes; each group is read as one span."""
    cuts = np.nonzero(np.diff(starts) - run > max_hole)[0] + 1
    yield from np.split(starts, cuts)


# ------------------------------------------------------------------------------------------------ import
def load_hf(path: str | Path, dtype=None) -> tuple[ModelConfig, dict]:
    """Reads ``path/config.json`` and its safetensors into ``(cfg, params)``: a numpy tree in ``dtype``
    (default ``cfg.param_dtype``), each parameter one whole :meth:`HFCheckpoint.read`. Lay it out with
    ``nereus_jax.sharding.shard_params``."""
    ckpt = HFCheckpoint(path)
    dtype = dtype or ckpt.config.param_dtype
    params: dict = {}
    for param in ckpt._rules:
        _set(params, param, ckpt.read(param, dtype=dtype))
    return ckpt.config, params


# ------------------------------------------------------------------------------------------------ export
def save_hf(path: str | Path, cfg: ModelConfig, params: Mapping, *, head: str | None = None, dtype=None,
            max_shard_bytes: int | None = DEFAULT_MAX_SHARD_BYTES,
            extra_config: Mapping[str, Any] | None = None) -> Path:
    """Writes ``config.json`` and safetensors that transformers' ``from_pretrained`` loads: one file, or
    shards of at most ``max_shard_bytes`` (None: no limit) plus ``model.safetensors.index.json``, one shard
    in memory at a time. ``params`` is a canonical host tree (np.asarray-able; gather laid-out parameters
    with ``nereus_jax.sharding.gather_params`` first); tensors keep their dtype unless ``dtype`` casts them.
    A tied model writes no ``lm_head.weight``; an o_proj bias (Llama/Qwen3 attention_bias) goes out as zeros,
    and so do the q/k/v biases of a bias-free Qwen2 (HF Qwen2 always has them)."""
    head = head or ("value" if "value_head" in params else "lm")
    if head not in HEAD_SUFFIX or (head == "value") != ("value_head" in params):
        raise ValueError(f"save_hf: head={head!r} does not fit a tree with top-level keys {sorted(params)}")
    num_labels = int(np.shape(params["value_head"]["kernel"])[1]) if head == "value" else 1
    embedding = params["embed"]["embedding"]
    out_dtype = _np_dtype(dtype if dtype is not None else getattr(embedding, "dtype", np.asarray(embedding).dtype))
    entries = _export_entries(params, cfg, head, num_labels, out_dtype)
    hf = hf_config_from_model(cfg, head=head, num_labels=num_labels, extra=extra_config)
    hf["dtype"] = out_dtype.name
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    _remove_stale_weights(path)
    (path / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    _write_tensors(path, entries, max_shard_bytes)
    return path


@dataclass(frozen=True)
class _Entry:
    """One HF tensor to write: its name, size, and how to make it (made only when its shard is written)."""

    name: str
    nbytes: int
    make: Callable[[], np.ndarray]


def _export_entries(params: Mapping, cfg: ModelConfig, head: str, num_labels: int, dtype: np.dtype) -> list[_Entry]:
    entries = []
    for rule in _rules(cfg, head):
        value = np.asarray(_get(params, rule.ours))
        expected = rule.our_shape(cfg, num_labels)
        if value.shape != expected:
            raise ValueError(f"save_hf: parameter {'/'.join(rule.ours)} has shape {value.shape}, expected {expected}: "
                             "pass a canonical tree (nereus_jax.sharding.gather_params drops a layout's kv copies)")
        nbytes = math.prod(rule.hf_shape(cfg, num_labels)) * dtype.itemsize
        for at, name in rule.names(cfg):
            x = value[at]
            entries.append(_Entry(name, nbytes,
                                  lambda x=x, rule=rule: rule.to_hf(x.astype(dtype, copy=False), cfg, num_labels)))
    return entries + [_Entry(name, size * dtype.itemsize, lambda size=size: np.zeros(size, dtype))
                      for name, size in _zero_tensors(cfg)]


def _zero_tensors(cfg: ModelConfig) -> list[tuple[str, int]]:
    """(name, size) of the tensors HF's model has and ours lacks, written as zeros: Llama's and Qwen3's
    o_proj bias under attention_bias, the q/k/v biases of a bias-free Qwen2."""
    layers = range(cfg.num_layers)
    out = [(_o_bias_name(i), cfg.hidden_size) for i in layers] if _has_o_bias(cfg) else []
    if cfg.family == "qwen2" and not cfg.qkv_bias:
        for w, heads in (("q", cfg.num_heads), ("k", cfg.num_kv_heads), ("v", cfg.num_kv_heads)):
            out += [(f"model.layers.{i}.self_attn.{w}_proj.bias", heads * cfg.head_dim) for i in layers]
    return out


def _write_tensors(path: Path, entries: list[_Entry], max_shard_bytes: int | None) -> None:
    shards = _split_shards(entries, max_shard_bytes)
    if len(shards) == 1:
        save_file({e.name: e.make() for e in shards[0]}, path / _SINGLE, metadata={"format": "pt"})
        return
    weight_map = {}
    for k, shard in enumerate(shards, start=1):
        name = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        save_file({e.name: e.make() for e in shard}, path / name, metadata={"format": "pt"})
        weight_map.update({e.name: name for e in shard})
    index = {"metadata": {"total_size": sum(e.nbytes for e in entries)}, "weight_map": dict(sorted(weight_map.items()))}
    (path / _INDEX).write_text(json.dumps(index, indent=2) + "\n")


def _split_shards(entries: list[_Entry], max_bytes: int | None) -> list[list[_Entry]]:
    """Greedy, in order; a tensor larger than ``max_bytes`` gets a shard of its own."""
    shards: list[list[_Entry]] = [[]]
    size = 0
    for e in entries:
        if max_bytes is not None and shards[-1] and size + e.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += e.nbytes
    return shards


def _remove_stale_weights(path: Path) -> None:
    """Drops a previous export's weight files, so no stale shard or index outlives this one."""
    for f in path.iterdir():
        if f.name in (_SINGLE, _INDEX) or re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", f.name):
            f.unlink()


# ------------------------------------------------------------------------------------------------ helpers
def _np_dtype(dtype) -> np.dtype:
    """A numpy dtype from a name ("float32", "bfloat16", ...) or dtype; bfloat16 is ml_dtypes' (what jax uses)."""
    if isinstance(dtype, str) and hasattr(ml_dtypes, dtype):
        return np.dtype(getattr(ml_dtypes, dtype))
    return np.dtype(dtype)


def _set(tree: dict, keys: tuple[str, ...], value) -> None:
    for key in keys[:-1]:
        tree = tree.setdefault(key, {})
    tree[keys[-1]] = value


def _get(tree: Mapping, keys: tuple[str, ...]):
    try:
        for key in keys:
            tree = tree[key]
    except KeyError:
        raise ValueError(f"save_hf: parameter {'/'.join(keys)} is missing from the tree") from None
    return tree
