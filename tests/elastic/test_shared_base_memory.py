"""The memory model counts LoRA's frozen base once per device among the units that hold it identically (the same
replica, layout, dtype, device memory), as the runtime shares its buffers (``nereus_jax.elastic.shared_base``):
predicted peaks against a reference computed here, from the model's parameters counted by hand and the cost
model's per-stage resident and working bytes summed without sharing."""

import dataclasses

import pytest

from nereus_jax.config import ModelConfig
from nereus_jax.elastic.adapter import ControllerAdapter
from nereus_jax.elastic.controller import Observation
from nereus_jax.elastic.costs import CostModel
from nereus_jax.elastic.hardware import get_hardware
from nereus_jax.elastic.plan import HOST, ExecutionPlan, StagePlan
from nereus_jax.elastic.pricing import Pricing
from nereus_jax.elastic.topology import Batching, Topology
from nereus_jax.elastic.workload import Workload
from nereus_jax.layout import Layout

# d=64, 4 heads of 16, 2 kv heads, mlp 256, 2 layers, vocab 128, untied lm head; float32 throughout
DENSE = ModelConfig(name="small", vocab_size=128, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                    intermediate_size=256, param_dtype="float32", compute_dtype="float32")
LORA = dataclasses.replace(DENSE, lora_rank=4)
MIXED = dataclasses.replace(LORA, compute_dtype="bfloat16")  # float32 parameters, bfloat16 scoring/generation
WL = Workload.fixed(4, 24, 40)
BATCHING = Batching(seq_len=64, micro_batch_tokens=128, max_concurrent_decodes=8)
HW = get_hardware("h100")
ACTOR_STAGES = ("actor-gen", "ref-infer", "actor-train")


def base_params(tp: int, head: str = "lm") -> float:
    """Scalars of the frozen base on one device of a tp group (tp <= 2 kv heads: no kv copies), by hand: the
    embedding's and an untied lm head's vocab shards, per layer q and o 64x64, k and v 64x32, gate/up/down
    64x256 split over tp, two norms whole; the final norm whole. ``head="trunk"``: without the lm head."""
    layer = (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 256) / tp + 2 * 64
    lm = 128 * 64 / tp if head == "lm" else 0
    return 128 * 64 / tp + 2 * layer + 64 + lm


def test_the_hand_count_is_the_models_parameter_tree():
    from nereus_jax.models.decoder import abstract_params, count_params

    assert base_params(1) == count_params(abstract_params(DENSE, head="lm"))
    assert base_params(1, "trunk") == count_params(abstract_params(DENSE, head="value", num_labels=0))


def _pricing(cfg: ModelConfig, algorithm: str = "grpo", usable: float = 1e15) -> Pricing:
    topo = Topology.of_job(algorithm, batching=BATCHING)
    return Pricing(CostModel(HW), topo, {r: cfg for r in ("actor", "ref", "critic", "reward")}, usable)


def _plan(**stages: StagePlan) -> ExecutionPlan:
    """Every unit on replicas (0, 1) and (2, 3) at tp=2, unless ``stages`` (name -> stage plan with "_" for "-")
    says otherwise."""
    default = StagePlan.contiguous(Layout(tp=2), 2)
    named = {k.replace("_", "-"): v for k, v in stages.items()}
    units = ("actor-gen", "ref-infer", "actor-train", "critic-train")
    return ExecutionPlan({u: named.get(u, default) for u in units})


def _for(pricing: Pricing, plan: ExecutionPlan) -> ExecutionPlan:
    return ExecutionPlan({ms: sp for ms, sp in plan.items() if str(ms) in pricing.topology.units})


def _unshared(pricing: Pricing, plan: ExecutionPlan) -> dict[int, float]:
    """The reference without sharing: on each device, every unit's resident bytes plus the largest working set
    of every stage running there (riders on their host's devices), from the cost model's stage memory."""
    choices = pricing.choices(plan, WL)
    placed = {str(ms): set(sp.devices) for ms, sp in plan.items()}
    host = {"actor-infer": "actor-train", "critic-infer": "critic-train"}
    out = {}
    for d in sorted(set().union(*placed.values())):
        mem = {s: pricing.cost.stage_memory(pricing.model_for(s), s, c, WL) for s, c in choices.items()
               if d in placed[host.get(s, s)]}
        out[d] = sum(m.resident for s, m in mem.items() if s not in host) + max(m.working for m in mem.values())
    return out


def _saving(pricing: Pricing, plan: ExecutionPlan) -> dict[int, float]:
    unshared = _unshared(pricing, plan)
    shared = pricing.device_bytes(plan, pricing.choices(plan, WL), WL)
    assert set(shared) == set(unshared)
    return {d: unshared[d] - shared[d] for d in unshared}


def test_colocated_actor_units_at_one_layout_and_dtype_hold_one_base():
    """actor-gen, ref-infer and actor-train on the same replicas at tp=2, all float32: each device holds one
    base where it held three (actor-infer rides on actor-train and holds none of its own)."""
    p = _pricing(LORA)
    plan = _for(p, _plan())
    base = base_params(2) * 4
    for d, saved in _saving(p, plan).items():
        assert saved == pytest.approx(2 * base, rel=1e-12), d
    unshared = max(_unshared(p, plan).values())
    assert p.peak_bytes(plan, p.choices(plan, WL), WL) == pytest.approx(unshared - 2 * base, rel=1e-12)


def test_a_unit_at_another_layout_or_replica_order_shares_nothing():
    """ref-infer at tp=1 (dp=4 on the same devices), or at tp=2 on the same devices in another order: only
    actor-gen and actor-train share, one copy saved."""
    p = _pricing(LORA)
    base = base_params(2) * 4
    other_tp = _for(p, _plan(ref_infer=StagePlan.contiguous(Layout(tp=1), 4)))
    reordered = _for(p, _plan(ref_infer=StagePlan(Layout(tp=2), ((1, 0), (3, 2)))))
    other_pp = _for(p, _plan(ref_infer=StagePlan(Layout(pp=2), ((0, 1), (2, 3)))))  # the same replicas
    for plan in (other_tp, reordered, other_pp):
        for d, saved in _saving(p, plan).items():
            assert saved == pytest.approx(base, rel=1e-12), (plan, d)


def test_units_share_only_with_those_holding_the_same_dtype():
    """float32 parameters, bfloat16 compute: actor-gen and ref-infer hold a bfloat16 base and share it;
    actor-train's float32 base is its own."""
    p = _pricing(MIXED)
    plan = _for(p, _plan())
    for d, saved in _saving(p, plan).items():
        assert saved == pytest.approx(base_params(2) * 2, rel=1e-12), d


def test_a_parked_unit_shares_nothing():
    p = _pricing(LORA)
    base = base_params(2) * 4
    parked = StagePlan.contiguous(Layout(tp=2), 2, memory=HOST)
    for plan, copies in ((_plan(ref_infer=parked), 1), (_plan(ref_infer=parked, actor_gen=parked), 0)):
        for d, saved in _saving(p, _for(p, plan)).items():
            assert saved == pytest.approx(copies * base, rel=1e-12, abs=0), (copies, d)


def test_units_on_different_replicas_share_only_where_they_hold_the_device_identically():
    """ref-infer on (0, 1) alone: devices 0 and 1 save two copies, devices 2 and 3 one (actor-gen and
    actor-train still share there)."""
    p = _pricing(LORA)
    base = base_params(2) * 4
    plan = _for(p, _plan(ref_infer=StagePlan.contiguous(Layout(tp=2), 1)))
    saving = _saving(p, plan)
    assert saving[0] == pytest.approx(2 * base) and saving[1] == pytest.approx(2 * base)
    assert saving[2] == pytest.approx(base) and saving[3] == pytest.approx(base)


def test_a_critic_on_the_actors_trunk_shares_it_and_one_from_its_own_checkpoint_does_not():
    """ppo, every unit at tp=2 on the same replicas, float32: the critic's trunk nests inside the actor's base,
    so a device holds the actor's base once (the sum less the largest: two actor bases and the trunk saved);
    a critic from ``critic_hf_path`` keeps its own trunk."""
    base, trunk = base_params(2) * 4, base_params(2, "trunk") * 4
    assert trunk < base  # the untied lm head is the actor's alone
    for cfg, saved_copies in ((LORA, 2 * base + trunk), (dataclasses.replace(LORA, critic_hf_path="/ckpt"), 2 * base)):
        p = _pricing(cfg, "ppo")
        plan = _for(p, _plan())
        assert {str(ms) for ms in plan} == {"actor-gen", "ref-infer", "actor-train", "critic-train"}
        for d, saved in _saving(p, plan).items():
            assert saved == pytest.approx(saved_copies, rel=1e-12), (cfg.critic_hf_path, d)


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
@pytest.mark.parametrize("compute", ["float32", "bfloat16"])
def test_without_lora_nothing_changes(algorithm, compute):
    """No frozen base without LoRA: the prediction is the unshared one, to the bit, on every plan above."""
    cfg = dataclasses.replace(DENSE, compute_dtype=compute)
    p = _pricing(cfg, algorithm)
    for plan in (_plan(), _plan(ref_infer=StagePlan.contiguous(Layout(tp=1), 4)),
                 _plan(ref_infer=StagePlan.contiguous(Layout(tp=2), 2, memory=HOST))):
        plan = _for(p, plan)
        choices = p.choices(plan, WL)
        bytes_of = {s: tuple(p.cost.stage_memory(p.model_for(s), s, c, WL)) for s, c in choices.items()}
        assert p.device_bytes(plan, choices, WL) == p.topology.device_bytes(plan, bytes_of.__getitem__)
        assert p.device_bytes(plan, choices, WL) == pytest.approx(_unshared(p, plan), rel=1e-12)


class _HomeOnly(ControllerAdapter):
    """The candidate policy offered one plan (the home plan): what survives is what its memory filter admits."""

    def __init__(self, pricing: Pricing, plan: ExecutionPlan):
        self.pricing, self.plan = pricing, plan

    def planning_workload(self):
        return WL

    def planned(self, obs, workload):
        return []

    def ran_plans(self):
        return []

    def home_plans(self, obs, workload):
        return [self.plan]

    def execution_plan(self, plan):
        return plan

    def choices_of(self, plan, workload):
        return self.pricing.choices(plan, workload)

    def price(self, plan, choices, workload):
        return self.pricing.latency(plan, choices, workload)

    def plan_peak_bytes(self, plan, choices, workload):
        return self.pricing.peak_bytes(plan, choices, workload)


def test_a_colocated_lora_plan_that_fits_only_with_one_base_is_admitted():
    """Usable bytes between the shared and the unshared peak: the plan fits (``Pricing.fits``), the controller's
    candidate filter offers it and the memory trigger does not fire; the same plan without LoRA's sharing (the
    unshared reference) would not fit."""
    probe = _pricing(LORA)
    plan = _for(probe, _plan())
    unshared = max(_unshared(probe, plan).values())
    shared = unshared - 2 * base_params(2) * 4
    usable = (shared + unshared) / 2
    p = _pricing(LORA, usable=usable)
    choices = p.choices(plan, WL)
    assert unshared > usable and p.fits(plan, choices, WL)
    assert p.peak_bytes(plan, choices, WL) <= p.trigger_bytes(usable)  # capacity = usable: no headroom left
    obs = Observation(step=1, plan=plan, devices=(0, 1, 2, 3), response_length=40.0)
    assert [c.plan for c in _HomeOnly(p, plan).candidates(obs)] == [plan]
    tight = _pricing(LORA, usable=shared * (1 - 1e-9))  # just under the shared peak: filtered out
    assert not tight.fits(plan, choices, WL) and _HomeOnly(tight, plan).candidates(obs) == []
