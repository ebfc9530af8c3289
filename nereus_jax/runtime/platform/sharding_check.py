"""The sharding check ``python -m nereus_jax.train --check-sharding`` runs: a sharded forward and gradient of
the configured model on the configured devices, each compared with a single-device run."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from rich.console import Console
from rich.table import Table

from nereus_jax.config import Config
from nereus_jax.models import count_params, forward, init_params
from nereus_jax.sharding import (
    Layout,
    activation_sharding,
    bytes_per_device,
    check_layout,
    gather_params,
    make_mesh,
    shard_params,
    sync_kv_grads,
)


def _loss(params, cfg, tokens_bt, mask_bt):
    """Next-token cross-entropy over real tokens (the supervised loss; enough to exercise gradients)."""
    logits = forward(params, cfg, tokens_bt[:, :-1], None, mask_bt[:, :-1])
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, tokens_bt[:, 1:, None], axis=-1)[..., 0]
    weight = mask_bt[:, 1:].astype(jnp.float32)
    return jnp.sum(nll * weight) / jnp.maximum(jnp.sum(weight), 1.0)


def _batch(cfg: Config, batch: int):
    m = cfg.model
    length = min(cfg.rollout.max_prompt_length + cfg.rollout.max_response_length, m.max_position_embeddings)
    tokens = jax.random.randint(jax.random.key(cfg.trainer.seed), (batch, length), 0, m.vocab_size)
    lengths = np.random.default_rng(cfg.trainer.seed).integers(length // 2, length + 1, size=batch)
    mask = (np.arange(length)[None, :] < lengths[:, None]).astype(np.int32)
    return np.asarray(tokens), mask


def run_sharding_check(cfg: Config) -> dict:
    """Runs the check, prints a table, returns a JSON-able summary (``ok`` when both match)."""
    m, plan = cfg.model, cfg.plan.default
    layout = Layout(tp=plan.tp, pp=plan.pp, ep=plan.ep)
    check_layout(m, layout, kind="train")  # before any compute
    devices = jax.devices()[: cfg.cluster.num_devices]
    dp = plan.dp or len(devices) // layout.size
    mesh = make_mesh(devices[: dp * layout.size], layout, dp=dp)
    params = init_params(m, seed=cfg.trainer.seed)
    tokens, mask = _batch(cfg, batch=2 * dp)

    ref_logits = jax.jit(forward, static_argnums=1)(params, m, tokens, None, mask)
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(_loss), static_argnums=1)(params, m, tokens, mask)

    sharded = shard_params(params, m, layout, mesh, kind="train")
    data = jax.device_put((tokens, mask), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("dp")))
    with activation_sharding(mesh, "train"):
        logits = jax.jit(forward, static_argnums=1)(sharded, m, data[0], None, data[1])
        loss, grads = jax.jit(jax.value_and_grad(_loss), static_argnums=1)(sharded, m, *data)

    logit_err = float(np.max(np.abs(np.asarray(logits) - np.asarray(ref_logits))))
    grad_err = _max_grad_error(grads, ref_grads, m)
    summary = {
        "job": "sharding-check (sharded forward and gradient vs one device; no RL steps)",
        "model": m.name, "params": count_params(params), "devices": len(devices),
        "layout": str(layout), "dp": dp, "batch": int(tokens.shape[0]), "seq_len": int(tokens.shape[1]),
        "loss": float(loss), "loss_single_device": float(ref_loss),
        "max_logit_error": logit_err, "max_grad_error": grad_err,
        "param_bytes_per_device": max(bytes_per_device(sharded).values()),
        "ok": logit_err < 1e-4 and grad_err < 1e-4,
    }
    _print(summary)
    return summary


def _max_grad_error(grads, ref_grads, cfg) -> float:
    host = gather_params(sync_kv_grads(grads, cfg), cfg)
    errs = jax.tree.map(lambda a, b: float(np.max(np.abs(np.asarray(a) - np.asarray(b)))), host, ref_grads)
    return max(jax.tree.leaves(errs))


def _print(summary: dict) -> None:
    table = Table(title="nereus_jax sharding check (sharded vs single device)")
    table.add_column("quantity")
    table.add_column("value", justify="right")
    for key, value in summary.items():
        table.add_row(key, f"{value:.3e}" if isinstance(value, float) else str(value))
    Console(stderr=True).print(table)
