"""One model of the job: the planner plans the topology and call sizes the job runs, its plans pass the job's
own memory check on the first try, and the runtime and the simulator price a plan identically."""

import dataclasses
import random
import subprocess
import sys

import pytest

from nereus_jax.config import load_config, resolve_model
from nereus_jax.elastic.costs import CostModel
from nereus_jax.elastic.hardware import get_hardware
from nereus_jax.elastic.planner import InfeasiblePlanError, Planner
from nereus_jax.elastic.pricing import Pricing
from nereus_jax.elastic.topology import Batching, Topology
from nereus_jax.elastic.workload import LengthStats, Workload

CPU_MODELS = ("tiny", "qwen2.5-0.5b")
GPU_MODELS = ("qwen2.5-0.5b", "qwen2.5-1.5b", "llama3.2-1b", "llama3.1-8b")
ALGORITHMS = ("grpo", "ppo", "dapo", "rloo", "gspo")


def _instance(rng: random.Random, gpu: bool):
    """A random (model, algorithm, cluster, workload, call sizes) the job could be configured with."""
    if gpu:
        hw = get_hardware(rng.choice(("a100", "h100", "h200")))
        devices = rng.choice((8, 16, 32, 64))
        model = resolve_model(rng.choice(GPU_MODELS))
        prompts, prompt, response = rng.choice((64, 128, 256)), rng.choice((256, 512)), rng.choice((512, 2048, 8192))
    else:
        hw = get_hardware("cpu")
        cap = rng.choice((None, 2**29, 2**30))
        hw = dataclasses.replace(hw, memory_bytes=cap) if cap else hw
        devices = rng.choice((1, 2, 4, 8))
        model = resolve_model(rng.choice(CPU_MODELS))
        prompts, prompt, response = rng.choice((4, 8, 16)), rng.choice((16, 64)), rng.choice((16, 64, 256))
    algorithm = rng.choice(ALGORITHMS)
    samples = rng.choice((2, 4))
    mean = response * rng.uniform(0.1, 0.9)
    wl = Workload(prompts, LengthStats.fixed(prompt), LengthStats(mean, min(response, mean * 1.5), response),
                  samples, mini_batches=rng.choice((1, 2)), packed=rng.random() < 0.5)
    batching = Batching(prompt + response, rng.choice((1024, 4096, 16384)) * (8 if gpu else 1),
                        rng.choice((8, 32, 64)), remat=rng.random() < 0.3)
    topo = Topology.of_job(algorithm, reward_model=rng.random() < 0.3, batching=batching)
    return hw, devices, model, algorithm, wl, topo


# gpu-table: ~110 s (CI time; run with -m long)
@pytest.mark.parametrize("gpu", [False, pytest.param(True, marks=pytest.mark.long)], ids=["cpu-table", "gpu-table"])
def test_the_planners_plan_is_the_jobs_plan_and_fits_its_memory_check_on_the_first_try(gpu):
    """100 random instances per hardware table: every plan the planner returns (best and runners-up) runs
    exactly the calls the job makes (its choices are the job's rule applied to the plan's layouts) and passes
    the job's per-device memory check; its per-device memory is the job's to the byte."""
    rng = random.Random(19 + gpu)
    planned = 0
    for _ in range(100):
        hw, devices, model, algorithm, wl, topo = _instance(rng, gpu)
        planner = Planner(CostModel(hw), headroom=0.1)
        models = {r: model for r in ("actor", "ref", "critic", "reward")}
        pricing = Pricing(planner.cost_model, topo, models, 0.9 * hw.memory_bytes)
        try:
            result = planner.plan(models, algorithm, wl, devices, topology=topo)
        except InfeasiblePlanError:
            continue
        planned += 1
        for r in (result, *result.runners_up):
            assert set(map(str, r.plan)) == set(topo.units)
            choices = pricing.choices(r.plan, wl)
            assert choices == dict(r.choices), (algorithm, devices, r.table())
            device_bytes = pricing.device_bytes(r.plan, choices, wl)
            assert max(device_bytes.values()) <= pricing.usable_bytes
            assert device_bytes == pytest.approx(dict(r.memory_per_device_bytes), rel=1e-12)
            assert r.step_latency_s == pytest.approx(pricing.latency(r.plan, choices, wl), rel=1e-12)
    assert planned >= 50  # half the instances or more have a plan: the check is not vacuous


def test_the_runtime_and_the_simulator_price_a_plan_identically():
    """The job's pricing (built from its config, as the adapter does) and the simulator's planning model
    (built from a trace) give the same step latency and peak bytes for the same plan and workload."""
    from nereus_jax.runtime.step.initial_plan import job_pricing, job_topology, plan_from_config
    from nereus_jax.sim.model import PlanningModel, SharedCaches
    from nereus_jax.sim.plan_cost import SimPlan, state_specs

    for overrides in ([], ["algorithm.name=ppo", "trainer.micro_batch_tokens=256"], ["model.remat=true"]):
        cfg = load_config("default", overrides)
        runtime = job_pricing(cfg)
        wl = Workload.from_config(cfg)
        plan = plan_from_config(cfg)
        choices = runtime.choices(plan, wl)
        topo = job_topology(cfg)
        hw = runtime.hardware
        sim = PlanningModel(runtime.models, cfg.algorithm.name, hw, topo, state_specs(runtime.models, topo.units),
                            SharedCaches(), planner={"headroom": cfg.controller.memory_headroom},
                            cost_model=CostModel(hw))
        sim_plan = SimPlan.build(choices, plan, topo)
        assert sim.predict(sim_plan, wl) == runtime.latency(plan, choices, wl)
        assert sim.peak_memory(sim_plan, wl) == runtime.peak_bytes(plan, choices, wl)
        assert sim.usable_bytes() == runtime.usable_bytes


def test_topology_and_pricing_import_without_jax():
    code = ("import sys, importlib.abc\n"
            "class Block(importlib.abc.MetaPathFinder):\n"
            "    def find_spec(self, name, path, target=None):\n"
            "        if name.split('.')[0] in ('jax', 'jaxlib', 'flax', 'optax'):\n"
            "            raise ImportError('JAX blocked: ' + name)\n"
            "sys.meta_path.insert(0, Block())\n"
            "from types import SimpleNamespace as NS\n"
            "from nereus_jax.config import resolve_model\n"
            "from nereus_jax.elastic.costs import CostModel\n"
            "from nereus_jax.elastic.pricing import Pricing\n"
            "from nereus_jax.elastic.topology import Batching, Topology\n"
            "from nereus_jax.elastic.workload import Workload\n"
            "topo = Topology((('actor-gen',), ('actor-infer',), ('actor-train',)), (('actor-infer', 'actor-train'),),\n"
            "                concurrent=False, batching=Batching(64, 1024, 16))\n"
            "m = resolve_model('tiny')\n"
            "p = Pricing(CostModel('cpu'), topo, {'actor': m}, 1e9)\n"
            "sp = lambda: NS(layout=NS(tp=1, pp=1), dp=2, devices=(0, 1))\n"
            "plan = {'actor-gen': sp(), 'actor-train': sp()}\n"
            "wl = Workload.fixed(8, 16, 16)\n"
            "assert p.latency(plan, p.choices(plan, wl), wl) > 0 and p.peak_bytes(plan, p.choices(plan, wl), wl) > 0\n"
            "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_the_jobs_topology_runs_scoring_on_the_training_units():
    topo = Topology.of_job("ppo")
    assert topo.units == ("actor-gen", "ref-infer", "actor-train", "critic-train")
    assert topo.host("actor-infer") == "actor-train" and topo.host("critic-infer") == "critic-train"
    assert not topo.has_state("actor-infer") and topo.has_state("ref-infer")
    assert "reward-infer" in Topology.of_job("grpo", reward_model=True).units
    assert Topology.of_job("grpo").stages == ("actor-gen", "actor-infer", "ref-infer", "actor-train")
    # the job runs its stages in turn: a chain, whatever the devices
    placed = {s: (0,) for s in topo.stages}
    seconds = {s: 1.0 for s in topo.stages}
    from nereus_jax.elastic.topology import critical_path

    assert critical_path(seconds, topo.edges(placed)) == len(topo.stages)
    # async: generation beside the rest
    assert critical_path(seconds, topo.edges(placed, overlapped=True)) == len(topo.stages) - 1
