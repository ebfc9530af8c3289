"""Exact parameter, FLOP and byte counts of the decoder under a layout: what the cost model prices.

Everything here is integer/float arithmetic on a ModelConfig (no JAX), mirroring the parameter tree of
``nereus_jax.models.decoder`` and the layout rules of ``nereus_jax.sharding``: heads, kv heads, mlp
and vocab split over tp (kv heads stored ``tp // num_kv_heads`` times when tp exceeds them), layers
over pp, norms and the value head replicated, embedding and output head replicated over pp. A mixture of
experts' stacked expert weights split over ep as well (each device holds num_experts / ep experts, each split
over tp on its mlp axis); everything else is replicated over ep, activations included (``sharding.rules``:
every device of an ep group runs the dense layers on all of the replica's rows).
tests/elastic/test_cost_model.py checks these counts against ``abstract_params`` / ``stored_shapes`` /
``check_layout``.
"""

from __future__ import annotations

from nereus_jax.config import ModelConfig

DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
HEADS = ("lm", "value")


def dtype_bytes(name: str) -> int:
    """Bytes per element of a config dtype name."""
    return DTYPE_BYTES[name]


def layout_problem(cfg: ModelConfig, tp: int, pp: int, ep: int = 1) -> str | None:
    """Why a (tp, pp, ep) layout cannot hold the model (the sharding module's rules), or None if it can."""
    if tp < 1 or pp < 1 or ep < 1:
        return f"degrees must be >= 1 (tp={tp}, pp={pp}, ep={ep})"
    if ep > 1 and not cfg.num_experts:
        return f"ep={ep} needs a mixture-of-experts model (model.num_experts=0): use ep=1"
    if ep > 1 and cfg.num_experts % ep:
        return f"ep={ep} does not divide model.num_experts={cfg.num_experts}"
    if ep > 1 and pp > 1:  # sharding.layout.check_layout refuses it: the runtime cannot differentiate it yet
        return f"ep={ep} with pp={pp}: expert parallelism does not run inside a pipeline; use pp=1 or ep=1"
    mlp = ("moe_intermediate_size", cfg.moe_intermediate_size) if cfg.num_experts else \
        ("intermediate_size", cfg.intermediate_size)
    for name, size in (("num_heads", cfg.num_heads), mlp, ("vocab_size", cfg.vocab_size)):
        if size % tp:
            return f"tp={tp} does not divide model.{name}={size}"
    kv = cfg.num_kv_heads
    if (tp <= kv and kv % tp) or (tp > kv and tp % kv):
        return f"tp={tp} neither divides nor is a multiple of model.num_kv_heads={kv}"
    if cfg.num_layers % pp:
        return f"pp={pp} does not divide model.num_layers={cfg.num_layers}"
    return None


def kv_copies(cfg: ModelConfig, tp: int) -> int:
    """How many times each kv head is stored (``sharding.kv_repeat``)."""
    return tp // cfg.num_kv_heads if tp > cfg.num_kv_heads else 1


def _layer_matmul_params(cfg: ModelConfig, kv_heads: int, active: bool = False, ep: int = 1) -> int | float:
    """Matmul weights of one layer split over tp: attention plus the MLP (with experts: all of them stored, 1/ep
    of them on one device of an expert group, or the ``num_experts_per_tok`` a token runs through when
    ``active``)."""
    mlp = _mlp_params(cfg, active)
    return _attention_params(cfg, kv_heads) + (mlp if ep == 1 else mlp / ep)


def _attention_params(cfg: ModelConfig, kv_heads: int) -> int:
    d, h, e = cfg.hidden_size, cfg.num_heads, cfg.head_dim
    return 2 * d * h * e + 2 * d * kv_heads * e


def _mlp_params(cfg: ModelConfig, active: bool = False) -> int:
    """One layer's MLP weights: the dense SwiGLU, or every expert (``active``: the top-k a token runs)."""
    d = cfg.hidden_size
    if cfg.num_experts:
        return (cfg.num_experts_per_tok if active else cfg.num_experts) * 3 * d * cfg.moe_intermediate_size
    return 3 * d * cfg.intermediate_size


def expert_flops_per_token(cfg: ModelConfig, tp: int) -> float:
    """Forward FLOPs of one layer's routed experts per token (its top-k, each split over tp); 0 for a dense MLP."""
    return 2.0 * _mlp_params(cfg, active=True) / tp if cfg.num_experts else 0.0


def busiest_shard_share(cfg: ModelConfig, ep: int, expert_load: float = 0.0):
    """The fraction of a layer's routed token-expert pairs that the busiest device of an ep group computes.
    ``expert_load`` (``Workload.expert_load``): the busiest expert's share of them, the others sharing the rest
    evenly; between 1 / num_experts (0 means that: balanced) and 1 / num_experts_per_tok (every token picks it:
    a token's top-k are distinct experts). Balanced: 1 / ep; one hot expert: its share plus its
    num_experts / ep - 1 shard mates'. 1 without experts or at ep = 1."""
    if not cfg.num_experts or ep == 1:
        return 1.0
    n = cfg.num_experts
    hot = min(max(expert_load, 1.0 / n), 1.0 / cfg.num_experts_per_tok)
    return hot + (n / ep - 1) * (1.0 - hot) / (n - 1)


def mlp_width(cfg: ModelConfig) -> int:
    """The MLP's hidden width (one expert's with experts): the GEMM width its matmuls run at."""
    return cfg.moe_intermediate_size if cfg.num_experts else cfg.intermediate_size


def _router_params(cfg: ModelConfig) -> int:
    """A mixture-of-experts layer's router [embed, experts], replicated over tp (0 for a dense MLP)."""
    return cfg.hidden_size * cfg.num_experts


def _layer_bias_params(cfg: ModelConfig, kv_heads: int) -> int:
    return (cfg.num_heads + 2 * kv_heads) * cfg.head_dim if cfg.qkv_bias else 0


def _layer_norm_params(cfg: ModelConfig) -> int:
    """The norms of one layer (replicated over tp): two over embed, plus Qwen3's q/k norms over head_dim (and
    the router of a mixture-of-experts layer, also replicated)."""
    return 2 * cfg.hidden_size + (2 * cfg.head_dim if cfg.qk_norm else 0) + _router_params(cfg)


def _head_params(cfg: ModelConfig, head: str, num_labels: int = 1) -> int:
    assert head in HEADS, head
    if head == "value":
        return cfg.hidden_size * num_labels
    return 0 if cfg.tie_embeddings else cfg.hidden_size * cfg.vocab_size


def param_count(cfg: ModelConfig, head: str = "lm", num_labels: int = 1) -> int:
    """Scalars in the canonical parameter tree (``count_params(abstract_params(cfg, head=...))``)."""
    k, d = cfg.num_kv_heads, cfg.hidden_size
    per_layer = _layer_matmul_params(cfg, k) + _layer_bias_params(cfg, k) + _layer_norm_params(cfg)
    return cfg.vocab_size * d + cfg.num_layers * per_layer + d + _head_params(cfg, head, num_labels)


def layer_params_per_device(cfg: ModelConfig, tp: int, ep: int = 1) -> float:
    """Scalars of one decoder layer on one device of a tp group (kv copies included, norms whole; with experts,
    its 1/ep of them)."""
    kv = cfg.num_kv_heads * kv_copies(cfg, tp)
    return (_layer_matmul_params(cfg, kv, ep=ep) + _layer_bias_params(cfg, kv)) / tp + _layer_norm_params(cfg)


def expert_params_per_device(cfg: ModelConfig, tp: int, pp: int, ep: int = 1) -> float:
    """Scalars of the routed experts one device stores under (tp, pp, ep) (0 for a dense model): the part of
    its parameters (and their gradients and optimizer state) that ep splits."""
    return cfg.num_layers / pp * _mlp_params(cfg) / ep / tp if cfg.num_experts else 0.0


def params_per_device(cfg: ModelConfig, tp: int, pp: int, head: str = "lm", num_labels: int = 1,
                      ep: int = 1) -> float:
    """Scalars one device stores under (tp, pp, ep): its layers' tp shard (kv copies included; experts split
    over ep too), the vocab shard of embedding and lm head (on every pp stage), norms and the value head whole."""
    d = cfg.hidden_size
    head_params = _head_params(cfg, head, num_labels) / (tp if head == "lm" else 1)
    return cfg.num_layers / pp * layer_params_per_device(cfg, tp, ep) + cfg.vocab_size * d / tp + d + head_params


def adapter_params_per_device(cfg: ModelConfig, tp: int, pp: int) -> float:
    """Scalars of the LoRA adapters one device stores under (tp, pp) (0 without ``model.lora_rank``): per
    adapted projection r * (in + out), the side split by tp (heads, kv heads with their copies, mlp) divided
    by tp, the embed side whole (``models/lora.py``'s axes)."""
    r = cfg.lora_rank
    if not r:
        return 0.0
    d, h, e, f = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.intermediate_size
    kv = cfg.num_kv_heads * kv_copies(cfg, tp)
    split = {"q_proj": h * e, "k_proj": kv * e, "v_proj": kv * e, "o_proj": h * e, "gate_proj": f, "up_proj": f,
             "down_proj": f}
    return cfg.num_layers / pp * sum(r * (d + split[t] / tp) for t in cfg.lora_targets)


def trainable_params_per_device(cfg: ModelConfig, tp: int, pp: int, head: str = "lm", num_labels: int = 1,
                                ep: int = 1) -> float:
    """Scalars training updates on one device (gradients, optimizer state): every parameter, or with LoRA the
    adapters plus a value head."""
    if not cfg.lora_rank:
        return params_per_device(cfg, tp, pp, head, num_labels, ep)
    return adapter_params_per_device(cfg, tp, pp) + (_head_params(cfg, head, num_labels) if head == "value" else 0)


def layer_flops_per_token(cfg: ModelConfig, tp: int) -> float:
    """Forward matmul FLOPs of one decoder layer per token on one device of a tp group."""
    return (2.0 * _layer_matmul_params(cfg, cfg.num_kv_heads * kv_copies(cfg, tp), active=True) / tp
            + 2.0 * _router_params(cfg))


def dense_flops_per_token(cfg: ModelConfig, tp: int) -> float:
    """Forward matmul FLOPs of one layer per token on one device of a tp group outside the routed experts
    (attention projections, the router): the part every device of an ep group runs on all of the rows."""
    return 2.0 * _attention_params(cfg, cfg.num_kv_heads * kv_copies(cfg, tp)) / tp + 2.0 * _router_params(cfg)


def head_flops_per_token(cfg: ModelConfig, tp: int, head: str = "lm", num_labels: int = 1) -> float:
    """Forward FLOPs of the output head per token on one device (lm head split over tp)."""
    if head == "value":
        return 2.0 * cfg.hidden_size * num_labels
    return 2.0 * cfg.hidden_size * cfg.vocab_size / tp


def attention_flops(cfg: ModelConfig, tp: int, queries: float, keys: float, fused: bool) -> float:
    """Forward attention FLOPs (QK^T and PV) of one layer on one device for ``queries`` query positions
    over ``keys`` key positions. A full causal pass has queries == keys: a fused kernel skips the masked
    half, our dense einsum computes the whole square."""
    pairs = queries * (keys + 1) / 2 if fused and queries == keys else queries * keys
    return 4.0 * cfg.num_heads / tp * cfg.head_dim * pairs


def kv_bytes_per_token(cfg: ModelConfig, tp: int, pp: int, dtype: str) -> float:
    """KV-cache bytes one device holds per cached token (keys and values of its layers and kv heads)."""
    heads = cfg.num_kv_heads * kv_copies(cfg, tp) / tp
    return 2.0 * cfg.num_layers / pp * heads * cfg.head_dim * dtype_bytes(dtype)


def layer_activation_bytes_per_token(cfg: ModelConfig, tp: int, dtype: str) -> float:
    """Activations one layer keeps per token for its backward pass on one device (inputs of every
    matmul and norm, the SwiGLU intermediates), excluding the [t, s] attention scores."""
    kv = cfg.num_kv_heads * kv_copies(cfg, tp)
    d, e = cfg.hidden_size, cfg.head_dim
    width = cfg.num_experts_per_tok * cfg.moe_intermediate_size if cfg.num_experts else cfg.intermediate_size
    sharded = 2 * cfg.num_heads * e + 2 * kv * e + 4 * width
    return (6 * d + sharded / tp) * dtype_bytes(dtype)


def attention_score_bytes(cfg: ModelConfig, tp: int, queries: float, keys: float, dtype: str) -> float:
    """Bytes of materialised attention scores of one layer (float32 scores and softmax, probabilities in
    the compute dtype) for ``queries`` x ``keys`` positions on one device; 0 under a fused kernel."""
    return cfg.num_heads / tp * queries * keys * (8 + dtype_bytes(dtype))
