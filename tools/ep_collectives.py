"""The collectives XLA compiles for a mixture-of-experts model whose experts are split over an expert axis: left to
the SPMD partitioner (GSPMD: the sharded weights and a plain forward) and with nereus_jax's expert-parallel layer
(``nereus_jax.sharding.experts``, what the job's programs run), for the forward and the gradient. JSON, one
entry per (layout, program, path): each collective's count and operand shapes, read from the compiled HLO.

    python tools/ep_collectives.py          # tiny Qwen3-MoE (8 experts, top-2), layouts ep2, ep4, tp2xep2; CPU

Expert parallelism means no device gathers another rank's experts: the GSPMD path's ``all-gather`` of
[experts, ...] weight shapes is what the expert-parallel layer removes (its one collective per layer is an
all-reduce of the layer's [b, t, d] output).
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import collections  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from nereus_jax.config import ModelConfig  # noqa: E402
from nereus_jax.models import forward, init_params  # noqa: E402
from nereus_jax.sharding import Layout, make_mesh, pipeline_forward_fn, shard_params  # noqa: E402

MOE = ModelConfig(family="qwen3_moe", qk_norm=True, vocab_size=96, hidden_size=32, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8, intermediate_size=48, moe_intermediate_size=16, num_experts=8,
                  num_experts_per_tok=2)
_OP = re.compile(r"= (\([^)]*\)|\S+) (all-gather|all-reduce|all-to-all|reduce-scatter|collective-permute|"
                 r"ragged-all-to-all)(?:-start)?\(")


def collectives(hlo: str) -> dict[str, dict]:
    """Collective op -> {"count", "shapes"} in a compiled HLO module's text."""
    out: dict[str, dict] = collections.defaultdict(lambda: {"count": 0, "shapes": set()})
    for shape, op in _OP.findall(hlo):
        out[op]["count"] += 1
        out[op]["shapes"].add(re.sub(r"\{[^}]*\}", "", shape))
    return {op: {"count": v["count"], "shapes": sorted(v["shapes"])} for op, v in out.items()}


def main() -> None:
    params = jax.tree.map(np.asarray, init_params(MOE, 0))
    tokens = jnp.asarray(np.random.default_rng(0).integers(1, MOE.vocab_size, (2, 9)), jnp.int32)
    rows = []
    for layout in (Layout(ep=2), Layout(ep=4), Layout(tp=2, ep=2)):
        mesh = make_mesh(jax.devices()[:layout.size], layout)
        sharded = shard_params(params, MOE, layout, mesh)
        for path, fn in (("gspmd", forward), ("expert_parallel", pipeline_forward_fn(mesh, 1))):
            programs = {"forward": lambda p, fn=fn: fn(p, MOE, tokens),
                        "gradient": jax.grad(lambda p, fn=fn: jnp.mean(fn(p, MOE, tokens) ** 2))}
            for name, program in programs.items():
                hlo = jax.jit(program).lower(sharded).compile().as_text()
                rows.append({"layout": str(layout), "program": name, "path": path, "collectives": collectives(hlo)})
    print(json.dumps({"model": "tiny qwen3_moe: 2 layers, hidden 32, 8 experts of width 16, top-2",
                      "experts_weight_shape_per_layer": [MOE.num_experts, MOE.hidden_size, MOE.moe_intermediate_size],
                      "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
