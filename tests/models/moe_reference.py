"""References for mixture-of-experts tests, written out here without the decoder's layer scan, router or
grouped matmuls: a forward whose router is overridden to choose recorded routes, and transformers'
load-balancing loss (numpy, and jnp for gradients). Used by tests/models/test_moe.py and the runtime's
loss tests."""

import jax
import jax.numpy as jnp
import numpy as np

from nereus_jax.models import causal_mask, default_positions
from nereus_jax.models import layers as L


def overridden_router_forward(params, cfg, tokens_bt, mask_bt, routes_btlk=None, *, return_hidden=False):
    """The forward written out layer by layer, each mixture-of-experts layer as every expert on every token
    weighted by the router's renormalised top-k, the router's logits raised by 1e4 at a token's recorded
    experts (``routes_btlk``, -1: none): a model whose router is overridden to choose the record. Returns
    (logits or final hidden states, each layer's unraised router logits [layers, b, t, experts])."""
    positions, mask_bts = default_positions(tokens_bt, mask_bt), causal_mask(tokens_bt.shape[1], mask_bt)
    inv_freq = L.rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    eps, x, gate_logits = cfg.rms_norm_eps, params["embed"]["embedding"][tokens_bt], []
    for i in range(cfg.num_layers):
        lp = jax.tree.map(lambda a, i=i: a[i], params["layers"])
        a, m = lp["attn"], lp["moe"]
        h = L.rms_norm(x, lp["attn_norm"]["scale"], eps)
        q = L.apply_rope(L.project_heads(h, a["wq"], None, a["q_norm"]["scale"], eps), positions, inv_freq)
        k = L.apply_rope(L.project_heads(h, a["wk"], None, a["k_norm"]["scale"], eps), positions, inv_freq)
        v = L.project_heads(h, a["wv"])
        x = x + jnp.einsum("bthe,hed->btd", L.attention(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3),
                                                        mask_bts), a["wo"])
        h = L.rms_norm(x, lp["mlp_norm"]["scale"], eps)
        logits = jnp.einsum("btd,de->bte", h, m["router"]).astype(jnp.float32)
        gate_logits.append(logits)
        if routes_btlk is not None:
            recorded = routes_btlk[:, :, i].astype(jnp.int32)
            chosen = jax.nn.one_hot(recorded, cfg.num_experts).sum(-2)
            logits = logits + 1e4 * chosen * jnp.all(recorded >= 0, axis=-1, keepdims=True)
        top, experts = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), cfg.num_experts_per_tok)
        top = top / top.sum(-1, keepdims=True)
        combine = jnp.einsum("btke,btk->bte", jax.nn.one_hot(experts, cfg.num_experts), top)
        every = jnp.stack([L.swiglu(h, m["w_gate"][e], m["w_up"][e], m["w_down"][e])
                           for e in range(cfg.num_experts)], axis=2)
        x = x + jnp.einsum("bted,bte->btd", every, combine)
    x = L.rms_norm(x, params["final_norm"]["scale"], eps)
    out = x if return_hidden else jnp.einsum("btd,dv->btv", x, params["lm_head"]["kernel"])
    return out, jnp.stack(gate_logits)


def random_routes(cfg, b, t, seed, missing=0.25):
    """Recorded routes [b, t, layers, k]: k distinct random experts per token and layer, -1 on a share of tokens."""
    rng = np.random.default_rng(seed)
    routes = np.stack([np.stack([rng.choice(cfg.num_experts, cfg.num_experts_per_tok, replace=False)
                                 for _ in range(cfg.num_layers)]) for _ in range(b * t)])
    routes = routes.reshape(b, t, cfg.num_layers, -1)
    routes[rng.random((b, t)) < missing] = -1
    return jnp.asarray(routes, jnp.int16)


def hf_load_balancing_loss_numpy(gate_logits_lbte, mask_bt, k):
    """transformers' load_balancing_loss_func (4.x's form: every layer's logits concatenated, one-hot top-k,
    attention-masked means), in numpy."""
    num_layers, _, _, e = gate_logits_lbte.shape
    logits = np.asarray(gate_logits_lbte, np.float64).reshape(-1, e)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    selected = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
    expert_mask = np.eye(e)[selected]                                    # [layers * b * t, k, e]
    flat_mask = np.broadcast_to(np.asarray(mask_bt, np.float64)[None], gate_logits_lbte.shape[:3]).reshape(-1)
    tokens_per_expert = (expert_mask * flat_mask[:, None, None]).sum(0) / flat_mask.sum()
    router_prob_per_expert = (probs * flat_mask[:, None]).sum(0) / flat_mask.sum()
    return float(np.sum(tokens_per_expert * router_prob_per_expert[None]) * e)


def hf_load_balancing_loss(gate_logits_lbte, mask_bt, k):
    """:func:`hf_load_balancing_loss_numpy` in jnp (differentiable as transformers' is: through the softmax
    probabilities, not the one-hot top-k)."""
    e = gate_logits_lbte.shape[-1]
    probs = jax.nn.softmax(gate_logits_lbte.reshape(-1, e), axis=-1)
    expert_mask = jax.nn.one_hot(jax.lax.top_k(probs, k)[1], e)
    flat_mask = jnp.broadcast_to(mask_bt.astype(jnp.float32)[None], gate_logits_lbte.shape[:3]).reshape(-1)
    tokens_per_expert = (expert_mask * flat_mask[:, None, None]).sum(0) / flat_mask.sum()
    router_prob_per_expert = (probs * flat_mask[:, None]).sum(0) / flat_mask.sum()
    return jnp.sum(tokens_per_expert * router_prob_per_expert[None]) * e
