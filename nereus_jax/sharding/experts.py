"""Expert parallelism: a mixture-of-experts layer with its experts split over the mesh's ``expert`` axis.

Left to the SPMD partitioner, experts sharded on their ``experts`` axis are all-gathered whole before the
grouped matmul (every device then holds every expert's weights for the layer: no expert parallelism). Here the
layer runs inside ``jax.shard_map``, manual over ``expert`` only (dp, pp and tp stay with the partitioner, so
tp-split experts work unchanged): each expert rank holds ``num_experts / ep`` experts, computes the pairs
routed to them (:func:`~nereus_jax.models.layers.local_experts_mlp`: the same dropless grouped matmul, on its
own experts' pairs only), and one ``psum`` over ``expert`` sums the ranks' outputs. Activations are whole on
every expert rank (see :mod:`nereus_jax.sharding.rules` for why), so no token moves: the combine is the only
collective, an all-reduce of the layer's [b, t, d] output, as tensor parallelism's MLP has.

Not inside a pipeline stage: nested in the pipeline's shard_map (manual over pp) the layer lowers forward but
not under autodiff (jax 0.12: the inner shard_map's residuals name the parent's manual axis), so layouts with
both ep > 1 and pp > 1 are refused (:func:`~nereus_jax.sharding.layout.check_layout`).

Model code never names this: :func:`expert_parallel_layer` installs the layer through
:func:`nereus_jax.models.layers.expert_parallel` (the hook :func:`~nereus_jax.models.layers.routed_experts`
reads), and :func:`~nereus_jax.sharding.layout.activation_sharding` and
:func:`~nereus_jax.sharding.pipeline.pipeline_forward_fn` install it for a mesh with an ``expert`` axis.

Example::

    mesh = make_mesh(jax.devices()[:4], Layout(ep=4))
    sharded = shard_params(params, cfg, Layout(ep=4), mesh)
    with activation_sharding(mesh):      # constraints and the expert-parallel layer
        logits = jax.jit(forward, static_argnums=1)(sharded, cfg, tokens)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax
from jax import lax
from jax.sharding import Mesh, PartitionSpec

from nereus_jax.models.layers import Routed, expert_parallel, local_experts_mlp

EXPERT_AXIS = "expert"


def expert_degree(mesh: Mesh) -> int:
    """The mesh's expert-parallel degree (1 when it has no ``expert`` axis)."""
    return mesh.shape[EXPERT_AXIS] if EXPERT_AXIS in mesh.axis_names else 1


def sharded_experts_mlp(mesh: Mesh, x_btd: jax.Array, routed: Routed, w_gate_edf: jax.Array, w_up_edf: jax.Array,
                        w_down_efd: jax.Array) -> jax.Array:
    """:func:`~nereus_jax.models.layers.experts_mlp` with the experts split over ``mesh``'s expert axis: each
    rank's local experts on their routed pairs, summed over the ranks."""
    def body(x, weights, experts, w_gate, w_up, w_down):
        # the whole inputs become per-rank values up front (their cotangents then psum over the ranks), so every
        # value the grouped matmul's custom VJP sees varies over the ranks alike (jax 0.10.2 checks that)
        x, weights = (lax.pcast(a, EXPERT_AXIS, to="varying") for a in (x, weights))
        first = lax.axis_index(EXPERT_AXIS) * w_gate.shape[0]
        part = local_experts_mlp(x, Routed(weights, experts, experts, None), w_gate, w_up, w_down, first)
        return lax.psum(part, EXPERT_AXIS)

    whole, split = PartitionSpec(), PartitionSpec(EXPERT_AXIS)
    fn = jax.shard_map(body, mesh=mesh, in_specs=(whole, whole, whole, split, split, split), out_specs=whole,
                       axis_names={EXPERT_AXIS})
    return fn(x_btd, routed.weights, routed.experts, w_gate_edf, w_up_edf, w_down_efd)


@contextlib.contextmanager
def expert_parallel_layer(mesh: Mesh) -> Iterator[None]:
    """While tracing inside this context, the model's routed experts run expert-parallel on ``mesh``
    (:func:`sharded_experts_mlp`); nothing changes when the mesh has no expert axis of size > 1."""
    if expert_degree(mesh) == 1:
        yield
        return

    def fn(x_btd, routed, w_gate_edf, w_up_edf, w_down_efd):
        return sharded_experts_mlp(mesh, x_btd, routed, w_gate_edf, w_up_edf, w_down_efd)

    with expert_parallel(fn):
        yield
