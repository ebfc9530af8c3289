"""Transitions keep every bit: states full of -0.0, subnormals, NaNs with payloads (quiet and signalling)
and infinities move between layouts bit for bit on every device, in float32 and bfloat16, also when the
move changes how many times the kv heads are stored (tp above num_kv_heads on one side); the relayout
programs only move the data (no reduction, no floating-point op on it, narrow floats as integers); and a
flipped bit in any unit a step makes, on any device, fails the transition with the old state intact."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from elastic_helpers import (
    ACTOR_GEN,
    ACTOR_TRAIN,
    REF,
    assert_bits,
    flip_bit,
    plan_pairs,
    with_special_values,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nereus_jax.config import ModelConfig
from nereus_jax.elastic import executor as executor_module
from nereus_jax.elastic.emu import EMU
from nereus_jax.elastic.executor import ChecksumMismatch, TransitionExecutor, TransitionFailed
from nereus_jax.elastic.graph import TransitionGraph
from nereus_jax.elastic.plan import ExecutionPlan, StagePlan
from nereus_jax.elastic.spec import StateSpec
from nereus_jax.elastic.weight_sync import WeightSync
from nereus_jax.models import init_params
from nereus_jax.sharding import Layout

C = StagePlan.contiguous
WIDE = ModelConfig(num_heads=8, num_kv_heads=2)  # tp 4 stores each kv head twice, tp 8 four times


@pytest.fixture(scope="module")
def wide():
    """Specs and special-valued states of an 8-head, 2-kv-head model: actor-train (float32 params and
    Adam) and actor-gen (bfloat16)."""
    tx = optax.adam(1e-3)
    params = jax.tree.map(np.asarray, init_params(WIDE, 0))
    opt = jax.tree.map(lambda x: np.asarray(x) + np.asarray(0.5, np.asarray(x).dtype), tx.init(params))
    gen = jax.tree.map(lambda x: np.asarray(jnp.asarray(x, jnp.bfloat16)), params)
    specs = {ACTOR_TRAIN: StateSpec(WIDE, "train", optimizer=tx), ACTOR_GEN: StateSpec(WIDE, "gen", dtype="bfloat16")}
    states = {ACTOR_TRAIN: with_special_values({"params": params, "opt": opt}, 0),
              ACTOR_GEN: with_special_values({"params": gen}, 1)}
    return specs, states


def _units(plan, specs, states):
    devices = jax.devices()
    return {ms: [EMU.create(ms, specs[ms], sp.layout, [devices[i] for i in r], states[ms], sp.memory)
                 for r in sp.replicas] for ms, sp in plan.items()}


@pytest.fixture
def programs(monkeypatch):
    """The compiled HLO of every relayout program the executor runs while the test runs."""
    texts = []
    real = executor_module._jitted

    def spy(*key):
        fn = real(*key)

        def call(leaves):
            compiled = fn.lower(leaves).compile()
            texts.append(compiled.as_text())
            return compiled(leaves)

        return call

    monkeypatch.setattr(executor_module, "_jitted", spy)
    return texts


COLLECTIVE = re.compile(r"=\s*(.*?)\s(all-gather|all-to-all|collective-permute|collective-broadcast)(-start)?\(")
FLOAT = r"(?:f\d+|bf16|f8\w*)\[[^\]]*\]"
ARITHMETIC = re.compile(rf"=\s*{FLOAT}\S*\s(add|subtract|multiply|divide|maximum|minimum|convert)\(")
NARROW_FLOAT = {"bf16", "f16", "f8e4m3fn", "f8e5m2"}


def assert_moves_bits_only(hlo: str):
    """No reduction collective, no arithmetic or conversion producing a float, and no collective on a float
    narrower than 32 bits (XLA:CPU would run it in float32)."""
    assert " all-reduce(" not in hlo and "all-reduce-start(" not in hlo, "a relayout reduces"
    assert " reduce-scatter(" not in hlo, "a relayout reduces"
    assert not ARITHMETIC.search(hlo), ARITHMETIC.search(hlo).group(0)
    for result, op, _ in COLLECTIVE.findall(hlo):
        types = set(re.findall(r"([a-z]+\d*\w*)\[", result))
        assert not types & NARROW_FLOAT, f"{op} moves {types}"


KV_MOVES = {  # (old, new) for actor-train and actor-gen alike; stored kv copies per layout in brackets
    "merge tp1[1] x2 -> tp4[2] elsewhere": (C(Layout(1), 2), C(Layout(4), 1, first=4)),
    "split tp4[2] x2 -> tp1[1] x4 shifted": (C(Layout(4), 2), C(Layout(1), 4, first=2)),
    "split tp8[4] -> tp2[1] x4": (C(Layout(8), 1), C(Layout(2), 4)),
    "merge tp2[1] x4 -> tp8[4]": (C(Layout(2), 4), C(Layout(8), 1)),
    "split tp8[4] -> tp4[2] x2": (C(Layout(8), 1), C(Layout(4), 2)),
    "merge tp4[2] x2 -> tp8[4]": (C(Layout(4), 2), C(Layout(8), 1)),
    "relayout tp4[2] x pp2 -> tp8[4]": (C(Layout(4, 2), 1), C(Layout(8), 1)),
    "relayout tp8[4] -> tp4[2] x pp2": (C(Layout(8), 1), C(Layout(4, 2), 1)),
    "relayout tp2[1] x pp2 -> tp4[2]": (C(Layout(2, 2), 1), C(Layout(4), 1)),
    "plain: tp2 x2 -> tp2 x4, tp2 -> tp1": (C(Layout(2), 2), C(Layout(1), 4, first=4)),
}


@pytest.mark.parametrize("name", list(KV_MOVES))
def test_special_values_survive_every_kind_of_move_bit_for_bit(wide, programs, name):
    specs, states = wide
    old_sp, new_sp = KV_MOVES[name]
    old = ExecutionPlan({ACTOR_TRAIN: old_sp, ACTOR_GEN: old_sp})
    new = ExecutionPlan({ACTOR_TRAIN: new_sp, ACTOR_GEN: new_sp})
    graph = TransitionGraph.build(old, new, specs)
    out = TransitionExecutor(checksums=True, verify_ledger=True).run(graph, _units(old, specs, states))
    for ms in new:
        assert [u.device_ids for u in out[ms]] == list(new[ms].replicas)
        assert_bits(out[ms], specs[ms], states[ms])
    assert programs, "every move above runs at least one relayout program"
    for hlo in programs:
        assert_moves_bits_only(hlo)


def test_a_repeat_ratio_that_is_not_whole_moves_bits_without_a_reduction(programs):
    """One kv head, tp3 x pp2 (three copies) -> tp2 x pp3 (two) on the same six devices: one Relayout."""
    cfg = ModelConfig(num_layers=6, num_heads=6, num_kv_heads=1, hidden_size=48, intermediate_size=96,
                      vocab_size=96)
    specs = {REF: StateSpec(cfg, "infer")}
    states = {REF: with_special_values({"params": jax.tree.map(np.asarray, init_params(cfg, 0))}, 2)}
    old, new = ExecutionPlan({REF: C(Layout(3, 2), 1)}), ExecutionPlan({REF: C(Layout(2, 3), 1)})
    graph = TransitionGraph.build(old, new, specs)
    assert [s.op for s in graph.steps] == ["relayout"]
    out = TransitionExecutor(checksums=True).run(graph, _units(old, specs, states))
    assert_bits(out[REF], specs[REF], states[REF])
    (hlo,) = programs
    assert_moves_bits_only(hlo)


def test_weight_sync_changing_the_kv_repeat_moves_bits_and_casts_like_xla(wide, programs):
    """Same dtype: bit for bit. Another dtype: XLA's convert of each value (the Derive's only float op),
    which the checksums reproduce, so checksums=True holds on special values too."""
    specs, states = wide
    f32_gen = StateSpec(WIDE, "gen", dtype="float32")
    for gen_spec, gen_layout in ((f32_gen, C(Layout(8), 1)), (specs[ACTOR_GEN], C(Layout(1), 8))):
        plan = ExecutionPlan({ACTOR_TRAIN: C(Layout(2), 2, first=4), ACTOR_GEN: gen_layout})
        units = _units(ExecutionPlan({ACTOR_TRAIN: plan[ACTOR_TRAIN]}), specs, states)[ACTOR_TRAIN]
        sync = WeightSync(plan, specs[ACTOR_TRAIN], gen_spec, executor=TransitionExecutor(checksums=True),
                          keep_old=True)
        gen = sync(units, [])
        params = {"params": states[ACTOR_TRAIN]["params"]}
        if gen_spec.dtype == np.float32:
            assert_bits(gen, gen_spec, params)
        else:
            cast = jax.jit(lambda t: jax.tree.map(lambda x: x.astype(jnp.bfloat16), t))(params)
            assert_bits(gen, gen_spec, jax.tree.map(np.asarray, cast))
        assert_bits(units, specs[ACTOR_TRAIN], states[ACTOR_TRAIN])  # the source is untouched
    for hlo in programs:
        assert " all-reduce(" not in hlo and " reduce-scatter(" not in hlo


def test_checksum_sees_a_flipped_bit_in_any_replica_or_kv_copy(wide):
    """Every device's block counts: a bit flipped in the second kv copy (tp 4) or in a replica of a
    leaf that tp does not split changes the checksum, which is equal across layouts otherwise."""
    specs, states = wide
    spec, state = specs[ACTOR_GEN], states[ACTOR_GEN]
    devices = jax.devices()
    a = EMU.create(ACTOR_GEN, spec, Layout(1), devices[:1], state)
    b = EMU.create(ACTOR_GEN, spec, Layout(4), devices[4:], state)
    assert np.array_equal(a.checksum(), b.checksum())
    kv = next(i for i, leaf in enumerate(spec.leaves) if leaf.kv_axis is not None)
    replicated = next(i for i, leaf in enumerate(spec.leaves) if "tp" not in jax.tree.leaves(tuple(leaf.spec)))
    for leaf in (kv, replicated):
        for shard in range(4):
            for bit in (0, 15):
                assert not np.array_equal(a.checksum(), flip_bit(b, leaf, shard, 5, bit).checksum()), (leaf, shard)


@pytest.mark.parametrize("name", ["split tp8[4] -> tp4[2] x2", "merge tp2[1] x4 -> tp8[4]"])
def test_a_corrupted_unit_fails_the_step_that_made_it_and_leaves_the_old_state(wide, name):
    specs, states = wide
    old_sp, new_sp = KV_MOVES[name]
    old, new = ExecutionPlan({ACTOR_TRAIN: old_sp}), ExecutionPlan({ACTOR_TRAIN: new_sp})
    graph = TransitionGraph.build(old, new, specs)
    last = max(s.sid for s in graph.steps if s.outputs)

    def corrupt(step, outputs):
        if step.sid == last:
            uid = min(outputs)
            outputs[uid] = flip_bit(outputs[uid], leaf=2, shard=1, element=3, bit=31)

    with pytest.raises(TransitionFailed) as info:
        TransitionExecutor(checksums=True, tamper=corrupt).run(graph, _units(old, specs, states))
    assert isinstance(info.value.__cause__, ChecksumMismatch) and info.value.step.sid == last
    assert info.value.plan == old  # the step that frees the old units never ran its frees
    assert_bits(info.value.units[ACTOR_TRAIN], specs[ACTOR_TRAIN], states[ACTOR_TRAIN])


# ------------------------------------------------------------------------------- properties
@pytest.fixture(scope="module")
def special_states(states):
    return {ms: with_special_values(state, seed) for seed, (ms, state) in enumerate(sorted(states.items()))}


def _settings(n: int):
    return settings(max_examples=n, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


@_settings(20)
@given(plan_pairs(stages=[ACTOR_TRAIN, ACTOR_GEN, REF], max_stages=2))
def test_random_moves_of_special_values_are_bit_exact(specs, special_states, pair):
    """(Checksums on special values are exercised above and below: each one compiles per device set.)"""
    old, new = pair
    budget = {ms: specs[ms] for ms in old}
    out = TransitionExecutor().run(TransitionGraph.build(old, new, budget), _units(old, specs, special_states))
    for ms, sp in new.items():
        assert [u.device_ids for u in out[ms]] == list(sp.replicas)
        assert_bits(out[ms], specs[ms], special_states[ms])


@_settings(6)
@given(plan_pairs(stages=[ACTOR_TRAIN, ACTOR_GEN], max_stages=1), st.integers(0, 2**16))
def test_a_flipped_bit_anywhere_is_always_caught(specs, special_states, pair, seed):
    old, new = pair
    graph = TransitionGraph.build(old, new, {ms: specs[ms] for ms in old})
    makers = [s.sid for s in graph.steps if s.outputs]
    if not makers:  # nothing new is made: nothing to corrupt
        return
    rng = np.random.default_rng(seed)
    target = makers[rng.integers(len(makers))]
    where = rng.integers(0, 2**16, size=5)

    def corrupt(step, outputs):
        if step.sid == target:
            uid = sorted(outputs)[where[0] % len(outputs)]
            outputs[uid] = flip_bit(outputs[uid], *where[1:])

    with pytest.raises(TransitionFailed) as info:
        TransitionExecutor(checksums=True, tamper=corrupt).run(graph, _units(old, specs, special_states))
    assert isinstance(info.value.__cause__, ChecksumMismatch), info.value
    for ms, units in info.value.units.items():
        assert [u.device_ids for u in units] == list(info.value.plan[ms].replicas)
        assert_bits(units, specs[ms], special_states[ms])
