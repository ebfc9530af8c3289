"""EMUs: lay out and gather bit for bit, bytes per device from shardings, checksums across layouts, and DP
replicas assembled into one SPMD state without copying (a data-parallel training step on it matches the
single-device step), split back the same way."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from elastic_helpers import ACTOR_TRAIN, REF, TINY, assert_state

from nereus_jax.elastic.emu import EMU, assemble_replicas, split_replicas
from nereus_jax.elastic.measured import measure
from nereus_jax.models import forward
from nereus_jax.sharding import Layout, activation_sharding


@pytest.mark.parametrize("layout", [Layout(1), Layout(2), Layout(4), Layout(2, 2), Layout(4, 2)])
def test_create_then_gather_is_bit_exact_and_bytes_come_from_shardings(devices, specs, states, layout):
    unit = EMU.create(ACTOR_TRAIN, specs[ACTOR_TRAIN], layout, devices[: layout.size], states[ACTOR_TRAIN])
    assert_state([unit], specs[ACTOR_TRAIN], states[ACTOR_TRAIN])
    per_device = unit.bytes_per_device()
    assert set(per_device) == set(range(layout.size))
    assert set(per_device.values()) == {specs[ACTOR_TRAIN].bytes_per_device(layout)}
    assert set(jax.tree.leaves(unit.opt_state)[1].sharding.device_set) == set(devices[: layout.size])


def test_checksum_is_equal_across_layouts_and_catches_a_changed_value(devices, specs, states):
    a = EMU.create(REF, specs[REF], Layout(1), devices[:1], states[REF])
    b = EMU.create(REF, specs[REF], Layout(4), devices[4:8], states[REF])  # kv heads stored twice
    assert np.array_equal(a.checksum(), b.checksum())
    changed = jax.tree.map(np.copy, states[REF])
    changed["params"]["final_norm"]["scale"][3] += 1.0
    c = EMU.create(REF, specs[REF], Layout(4), devices[4:8], changed)
    assert not np.array_equal(a.checksum(), c.checksum())


def _loss(params, tokens_bt):
    logits = forward(params, TINY, tokens_bt[:, :-1])
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, tokens_bt[:, 1:, None], axis=-1))


def test_dp_replicas_train_as_one_spmd_program_assembled_and_split_without_copies(devices, specs, states, tx):
    spec, layout = specs[ACTOR_TRAIN], Layout(2)
    units = [EMU.create(ACTOR_TRAIN, spec, layout, devices[i:i + 2], states[ACTOR_TRAIN]) for i in (0, 2)]
    leaves, mesh = assemble_replicas(units)
    assert mesh.axis_names == ("dp", "pp", "tp") and mesh.devices.shape == (2, 1, 2)
    pointers = lambda xs: {s.data.unsafe_buffer_pointer() for x in xs for s in x.addressable_shards}  # noqa: E731
    assert pointers(leaves) == pointers(u.leaves[i] for u in units for i in range(len(leaves)))
    assert measure(leaves + [x for u in units for x in u.leaves]) == measure(leaves)

    tokens = np.asarray(jax.random.randint(jax.random.key(0), (4, 9), 0, TINY.vocab_size))

    def step(state, tokens_bt):
        grads = jax.grad(_loss)(state["params"], tokens_bt)
        updates, opt = tx.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}

    shardings = spec.unflatten([x.sharding for x in leaves])
    data = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("dp"))
    with activation_sharding(mesh, "train"):
        out = jax.jit(step, out_shardings=shardings)(spec.unflatten(leaves), jax.device_put(tokens, data))
    replicas = split_replicas(spec.flatten(out), mesh, ACTOR_TRAIN, spec)
    assert [r.device_ids for r in replicas] == [(0, 1), (2, 3)]

    want = jax.jit(step)(jax.tree.map(jnp.asarray, states[ACTOR_TRAIN]), tokens)
    for r in replicas:
        for a, b in zip(spec.flatten(r.to_host()), spec.flatten(want), strict=True):
            np.testing.assert_allclose(a, np.asarray(b), rtol=2e-5, atol=2e-6)


def test_split_units_build_their_arrays_on_first_read_and_reassemble_to_the_split_arrays(devices, specs, states):
    spec, layout = specs[ACTOR_TRAIN], Layout(2)
    units = [EMU.create(ACTOR_TRAIN, spec, layout, devices[i:i + 2], states[ACTOR_TRAIN]) for i in (0, 2, 4)]
    leaves, mesh = assemble_replicas(units)
    replicas = split_replicas(leaves, mesh, ACTOR_TRAIN, spec)
    assert all("leaves" not in r.__dict__ for r in replicas)  # nothing built yet
    again, mesh2 = assemble_replicas(replicas)  # the units as split: the very arrays, none of them built
    assert mesh2 is mesh and all(a is b for a, b in zip(again, leaves, strict=True))
    assert all("leaves" not in r.__dict__ for r in replicas)
    # read: each replica's arrays are views of the split arrays' buffers on its own devices, values intact
    pointers = lambda xs: {s.data.unsafe_buffer_pointer() for x in xs for s in x.addressable_shards}  # noqa: E731
    assert pointers(x for r in replicas for x in r.leaves) == pointers(leaves)
    for r, u in zip(replicas, units, strict=True):
        assert r.device_ids == u.device_ids and r.layout == u.layout
        for a, b in zip(spec.flatten(r.to_host()), spec.flatten(u.to_host()), strict=True):
            np.testing.assert_array_equal(a, b)
    # a different selection (another order, a subset) is assembled from the units' own arrays
    order = [replicas[2], replicas[0]]
    leaves2, mesh3 = assemble_replicas(order)
    assert [d.id for d in mesh3.devices.flat] == [d.id for r in order for d in r.devices]
    assert pointers(leaves2) == pointers(x for r in order for x in r.leaves)
