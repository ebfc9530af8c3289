"""The execution plan a job starts from, derived from the config's ``plan`` section.

The job's model-stages depend on the algorithm: actor-gen, actor-train and ref-infer always; critic-train
for algorithms with a critic. actor-infer and critic-infer run on the training units' parameters (the
same layout and devices as actor-train / critic-train), so they need no state of their own. reward-infer
is a model-stage when ``task.reward_model_path`` names a reward model; otherwise the task's verifiable
reward runs on the host.
"""

from __future__ import annotations

import dataclasses

from nereus_jax.config import Config, ConfigError, ModelConfig
from nereus_jax.elastic.costs import CostModel
from nereus_jax.elastic.hardware import get_hardware
from nereus_jax.elastic.plan import ExecutionPlan, StagePlan
from nereus_jax.elastic.pricing import Pricing
from nereus_jax.elastic.topology import Batching, Topology
from nereus_jax.elastic.workload import Workload
from nereus_jax.layout import Layout
from nereus_jax.model_stage import ACTOR_GEN, ModelStage, job_roles

AUTO_MICRO_BATCH_TOKENS = 4096  # trainer.micro_batch_tokens=null starts here and halves until the plan fits


def with_micro_batch_tokens(cfg: Config) -> Config:
    """``cfg`` with ``trainer.micro_batch_tokens`` set: as given, or (null) the largest of 4096, 2048, ...
    whose predicted peak per device under the starting plan (:func:`plan_from_config`) fits the usable memory,
    stopping at one row of prompt + response (which may still not fit: :func:`predicted_peak` says)."""
    if cfg.trainer.micro_batch_tokens is not None:
        return cfg
    row = cfg.rollout.max_prompt_length + cfg.rollout.max_response_length
    budget = AUTO_MICRO_BATCH_TOKENS
    while True:
        tried = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, micro_batch_tokens=budget))
        try:
            peak, usable = predicted_peak(tried)
        except ValueError:  # the plan's dp cannot split a batch: the job's row check names that and its fix
            return tried
        if peak <= usable or budget <= row:
            return tried
        budget //= 2


def predicted_peak(cfg: Config, plan: ExecutionPlan | None = None) -> tuple[float, float]:
    """(the memory model's peak bytes per device of ``plan`` (default: the starting plan) on the configured
    worst case: every prompt and response at its maximum, the shapes padded programs run; usable bytes).
    ValueError when the plan's dp cannot split a stage's batch."""
    pricing, workload = job_pricing(cfg), Workload.from_config(cfg)
    plan = plan_from_config(cfg) if plan is None else plan
    return pricing.peak_bytes(plan, pricing.choices(plan, workload), workload), pricing.usable_bytes


def job_topology(cfg: Config) -> Topology:
    """What this config's job runs, for the planner and the pricing: scoring on the training units,
    stages in turn (async: generation beside the rest), calls cut by the token budget."""
    cfg = with_micro_batch_tokens(cfg)
    batching = Batching(cfg.rollout.max_prompt_length + cfg.rollout.max_response_length, cfg.trainer.micro_batch_tokens,
                        cfg.rollout.max_concurrent_decodes, cfg.model.remat)
    return _of_job(cfg, batching)


def _of_job(cfg: Config, batching: Batching | None = None) -> Topology:
    return Topology.of_job(cfg.algorithm.name, reward_model=bool(cfg.task.reward_model_path),
                           asynchronous=cfg.trainer.mode == "async", batching=batching)


def job_pricing(cfg: Config) -> Pricing:
    """The job's prices: its topology under a cost model of its hardware (``controller.hardware`` or
    ``cluster.hardware``, capped at ``cluster.device_memory_bytes``), usable bytes = cap less the headroom."""
    hardware = get_hardware(cfg.controller.hardware or cfg.cluster.hardware)
    if cfg.cluster.device_memory_bytes:  # plan against the cap the cluster sets, not the datasheet's
        hardware = dataclasses.replace(hardware, memory_bytes=cfg.cluster.device_memory_bytes)
    usable = hardware.memory_bytes * (1 - cfg.controller.memory_headroom)
    return Pricing(CostModel(hardware), job_topology(cfg), job_models(cfg), usable,
                   share_base=cfg.plan.share_frozen_base)


def job_models(cfg: Config) -> dict[str, ModelConfig]:
    """Role -> network: every role of the declared model-stages shares the policy's architecture."""
    return {role: cfg.model for role in job_roles()}


def job_stages(cfg: Config) -> list[ModelStage]:
    """The model-stages the job places (each its own units): its topology's unit stages
    (:mod:`nereus_jax.elastic.topology`, the one description of what a step runs), in run order."""
    return [ModelStage.parse(s) for s in _of_job(cfg).units]


def plan_from_config(cfg: Config, device_ids: list[int] | None = None) -> ExecutionPlan:
    """Colocated: every model-stage's replicas start at the first device (stages take turns). Split:
    actor-gen gets the first block of devices, the other stages share the rest."""
    ids = list(range(cfg.cluster.num_devices)) if device_ids is None else list(device_ids)
    stages = job_stages(cfg)
    if cfg.plan.colocate:
        return ExecutionPlan({ms: _stage_plan(cfg, ms, ids) for ms in stages})
    gen = _stage_plan(cfg, ACTOR_GEN, ids, share=2)
    rest = [d for d in ids if d not in gen.devices]
    if not rest:
        raise ConfigError(f"plan.colocate=false: actor-gen takes all {len(ids)} devices, none are left for "
                          "training; give actor-gen a smaller dp or set plan.colocate=true")
    return ExecutionPlan({ACTOR_GEN: gen, **{ms: _stage_plan(cfg, ms, rest) for ms in stages[1:]}})


def _stage_plan(cfg: Config, ms: ModelStage, ids: list[int], share: int = 1) -> StagePlan:
    lc = cfg.plan.layout_for(str(ms))
    layout = Layout(tp=lc.tp, pp=lc.pp, ep=lc.ep)
    dp = lc.dp or max(1, len(ids) // share // layout.size)
    if dp * layout.size > len(ids):
        raise ConfigError(f"plan.stages.{ms}: {layout} x dp={dp} needs {dp * layout.size} devices, only "
                          f"{len(ids)} are available to it; lower dp/tp/pp/ep or raise cluster.num_devices")
    return StagePlan(layout, tuple(tuple(ids[i * layout.size:(i + 1) * layout.size]) for i in range(dp)))
