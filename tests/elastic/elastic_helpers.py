"""Model-stages, the tiny model, and checks shared by the elastic tests: every check compares a unit's
gathered canonical state with the host state it was made from, bit for bit. Also: states full of special
floating-point values, a check of every device's raw bytes, a one-bit corruption of a unit, and hypothesis
strategies for random plan pairs on 8 devices."""

import jax
import numpy as np
from hypothesis import strategies as st

from nereus_jax import model_stage
from nereus_jax.config import ModelConfig
from nereus_jax.elastic.emu import EMU
from nereus_jax.elastic.plan import DEVICE, HOST, ExecutionPlan, StagePlan
from nereus_jax.sharding import Layout

TINY = ModelConfig()  # 4 heads, 2 kv heads: tp=4 stores each kv head twice
ACTOR_TRAIN, ACTOR_GEN = model_stage.ACTOR_TRAIN, model_stage.ACTOR_GEN
REF, CRITIC = model_stage.REF_INFER, model_stage.CRITIC_TRAIN


def assert_state(units, spec, state):
    """Every unit holds ``state`` bit for bit (params and optimizer state)."""
    want = spec.flatten(state)
    for unit in units:
        got = spec.flatten(unit.to_host())
        assert len(got) == len(want)
        for a, b in zip(want, got, strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape
            np.testing.assert_array_equal(a, b)


def assert_plan_units(out, plan, specs, states):
    """``out`` holds exactly ``plan``'s replicas, each bit-exact."""
    assert set(out) == set(plan)
    for ms, sp in plan.items():
        assert [u.device_ids for u in out[ms]] == list(sp.replicas)
        assert all(u.layout == sp.layout and u.memory == sp.memory for u in out[ms])
        assert_state(out[ms], specs[ms], states[ms])


# ------------------------------------------------------------------------------- special values
# Raw bit patterns: -0.0, the smallest subnormal, a negative subnormal, quiet NaNs with payloads, signalling
# NaNs (a payload without the quiet bit) of both signs, +inf, -inf.
SPECIAL_BITS = {
    np.dtype(np.float32): np.array([0x80000000, 0x00000001, 0x807FFFFF, 0x7FC00001, 0xFFC12345, 0x7F800001,
                                    0xFFA00ABC, 0x7F800000, 0xFF800000], np.uint32),
    np.dtype(jax.numpy.bfloat16): np.array([0x8000, 0x0001, 0x807F, 0x7FC1, 0xFFC5, 0x7F81, 0xFFA5, 0x7F80,
                                            0xFF80], np.uint16),
}


def raw(a: np.ndarray) -> np.ndarray:
    """The bytes of ``a`` as unsigned integers of its width (NaN == NaN, -0.0 != 0.0)."""
    a = np.asarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def with_special_values(state, seed: int):
    """``state`` with about a third of every floating leaf's values replaced by special bit patterns."""
    rng = np.random.default_rng(seed)

    def fill(x):
        x = np.array(x)
        patterns = SPECIAL_BITS.get(x.dtype)
        if patterns is None:
            return x
        bits = raw(x).reshape(-1)
        where = rng.choice(bits.size, size=max(1, bits.size // 3), replace=False)
        bits[where] = patterns[np.arange(where.size) % patterns.size]  # every pattern where there is room
        return x

    return jax.tree.map(fill, state)


def assert_bits(units, spec, state):
    """Every device's shard of every stored leaf (kv copies and replicas included) holds ``state``'s bytes."""
    want = [np.asarray(x) for x in spec.flatten(state)]
    for unit in units:
        stored = spec.expand(want, spec.repeat(unit.layout))
        for i, (x, w) in enumerate(zip(unit.leaves, stored, strict=True)):
            assert x.dtype == w.dtype and x.shape == w.shape, (unit, i)
            for shard in x.addressable_shards:
                np.testing.assert_array_equal(raw(np.asarray(shard.data)), raw(w[shard.index]),
                                              err_msg=f"{unit} leaf {i} on {shard.device}")


def flip_bit(unit: EMU, leaf: int, shard: int, element: int, bit: int) -> EMU:
    """A copy of ``unit`` with one bit flipped in one device's shard of one leaf (indices wrap around)."""
    leaves = list(unit.leaves)
    x = leaves[leaf % len(leaves)]
    shards = list(x.addressable_shards)
    target = shards[shard % len(shards)]
    host = np.array(target.data)
    bits = raw(host).reshape(-1)
    bits[element % bits.size] ^= bits.dtype.type(1) << bits.dtype.type(bit % (8 * bits.dtype.itemsize))
    where = jax.sharding.SingleDeviceSharding(target.device, memory_kind=x.sharding.memory_kind)
    arrays = [jax.device_put(host, where) if s is target else s.data for s in shards]
    leaves[leaf % len(leaves)] = jax.make_array_from_single_device_arrays(x.shape, x.sharding, arrays)
    return EMU(unit.stage, unit.layout, unit.devices, leaves, unit.spec, unit.memory)


# ------------------------------------------------------------------------------- random plans
PLAN_LAYOUTS = [Layout(1, 1), Layout(2, 1), Layout(4, 1), Layout(1, 2), Layout(2, 2), Layout(4, 2)]
PLAN_STAGES = [ACTOR_TRAIN, REF, ACTOR_GEN]


@st.composite
def stage_plans(draw, layouts=tuple(PLAN_LAYOUTS)):
    layout = draw(st.sampled_from(layouts))
    dp = draw(st.integers(1, 8 // layout.size))
    order = draw(st.permutations(range(8)))
    replicas = tuple(tuple(order[i * layout.size:(i + 1) * layout.size]) for i in range(dp))
    memory = draw(st.sampled_from([DEVICE, DEVICE, DEVICE, HOST]))
    return StagePlan(layout, replicas, memory)


@st.composite
def plan_pairs(draw, stages=PLAN_STAGES, max_stages: int = 3, layouts=tuple(PLAN_LAYOUTS)):
    chosen = draw(st.lists(st.sampled_from(stages), min_size=1, max_size=max_stages, unique=True))
    old = ExecutionPlan({ms: draw(stage_plans(layouts)) for ms in chosen})
    new = ExecutionPlan({ms: draw(stage_plans(layouts)) for ms in chosen})
    return old, new
