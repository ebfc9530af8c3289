"""The typed, validated configuration tree of a nereus_jax job.

One frozen dataclass per concern (model, cluster, plan, rollout, algorithm, trainer, task, controller,
checkpoint, logging), read from YAML and changed from the command line with dotted `key.sub=value`
overrides whose values are parsed as YAML (`5` is an int, `3e-6` a float, `[1, 2]` a list, `null` None):

    python -m nereus_jax.train configs/default.yaml trainer.steps=5 algorithm.name=grpo \\
        rollout.samples_per_prompt=4 model=qwen2.5-0.5b model.num_layers=2 \\
        plan.stages.actor-gen.tp=2 'cluster.schedule=[{step: 3, leave: [7]}]'

`model` is a preset name from `configs/models/` (`model: llama3.1-8b`) or a mapping; a mapping's `preset`
key picks the base preset and its other keys change it. `model=NAME` and `model.preset=NAME` overrides are
applied before the other overrides, so `model.num_layers=2` changes whichever preset was chosen.
A bare config name (`default`) means `configs/default.yaml`.

Unknown keys, wrong types and impossible combinations raise `ConfigError`, whose message names the full
dotted key and what to change. Pure Python + PyYAML: no JAX, so the planner, the simulator and `--help`
work on machines without accelerators. `describe()` prints every key with its type and default.
"""

import copy
import dataclasses
import difflib
import json
import os
import typing
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from nereus_jax._typed_tree import (
    ConfigError,
    field_types,
    from_dict,
    join,
    parse_yaml,
    require,
    show,
    to_plain,
    type_name,
    unknown_name_error,
)
from nereus_jax.model_stage import stage_names
from nereus_jax.vocab_chunks import DEFAULT_VOCAB_CHUNK

_PRESET_KEYS = ("model", "model.preset")
_WANDB_PROJECT_FORBIDS = "/\\#?%:"  # wandb.init rejects these in a project name (its settings' validate_project)
PIPELINE_SCHEDULES = ("1f1b", "gpipe")  # trainer.pipeline_schedule; the cost model prices the one that runs


def _field(default: Any, help: str) -> Any:
    """A dataclass field with a one-line explanation that `describe()` prints."""
    return field(default=default, metadata={"help": help})


class _Node:
    """Behaviour shared by every section of the tree."""

    def to_dict(self) -> dict[str, Any]:
        """Plain dicts, lists and scalars (YAML/JSON-safe); `config_from_dict` reads it back."""
        return to_plain(self)


# ----------------------------------------------------------------------------------------------- sections
@dataclass(frozen=True)
class RopeScalingConfig(_Node):
    """Llama 3 style RoPE frequency scaling for long contexts."""

    rope_type: Literal["llama3"] = "llama3"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        names = ("factor", "low_freq_factor", "original_max_position_embeddings")
        _check_positive("model.rope_scaling", self, *names)
        require(
            self.high_freq_factor > self.low_freq_factor,
            f"model.rope_scaling.high_freq_factor ({self.high_freq_factor}) must exceed "
            f"model.rope_scaling.low_freq_factor ({self.low_freq_factor}): llama3 scaling "
            "interpolates between the two wavelength bounds",
        )


# The projections LoRA can adapt, by their Hugging Face module names (nereus_jax.models.lora maps them).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ModelConfig(_Node):
    """Decoder architecture (Llama / Qwen2 / Qwen3 family) and its dtypes; presets live in configs/models/,
    or ``hf_path`` names a local Hugging Face checkpoint whose config.json gives the architecture."""

    name: str = "tiny"
    hf_path: str | None = _field(
        None, "local Hugging Face checkpoint dir (config.json, *.safetensors, tokenizer): its config.json sets "
              "the architecture, its weights start actor-train, actor-gen, ref-infer and the critic's trunk")
    critic_hf_path: str | None = _field(
        None, "local *ForSequenceClassification checkpoint the critic starts from (null: the actor's trunk "
              "with a zero value head)")
    family: Literal["llama", "qwen2", "qwen3", "qwen3_moe"] = "llama"
    vocab_size: int = 128
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int | None = _field(None, "null -> hidden_size // num_heads (derived once, at construction)")
    intermediate_size: int = 256
    num_experts: int = _field(0, "experts per mixture-of-experts layer (0: a dense MLP; Qwen3-MoE)")
    num_experts_per_tok: int = _field(2, "experts each token is routed to (top-k of the router)")
    moe_intermediate_size: int | None = _field(None, "each expert's MLP width (null: intermediate_size)")
    norm_topk_prob: bool = _field(True, "renormalise the top-k routing weights to sum to 1 (Qwen3-MoE)")
    rope_theta: float = 10000.0
    rope_scaling: RopeScalingConfig | None = None
    rms_norm_eps: float = 1e-5
    qkv_bias: bool = False
    qk_norm: bool = _field(False, "per-head RMSNorm on queries and keys before RoPE (Qwen3)")
    tie_embeddings: bool = False
    max_position_embeddings: int = 2048
    param_dtype: Literal["float32", "bfloat16"] = _field("float32", "master weights and optimizer state")
    compute_dtype: Literal["float32", "bfloat16"] = _field("float32", "generation/inference compute, weights")
    remat: bool = _field(False, "rematerialise activations in training (time for memory)")
    lora_rank: int = _field(0, "LoRA rank r: > 0 trains low-rank adapters on lora_targets and freezes the base "
                               "(0: full fine-tuning)")
    lora_alpha: float = _field(16.0, "LoRA scaling numerator: the adapters' output is scaled by lora_alpha / "
                                     "lora_rank (PEFT's convention)")
    lora_targets: tuple[str, ...] = _field(
        LORA_TARGETS,
        "projections that get adapters, by their Hugging Face module names")
    lora_dropout: float = _field(0.0, "LoRA dropout: probability of zeroing an adapter's input element in actor- "
                                      "and critic-train's forwards (never in scoring, the reference or generation)")
    lora_path: str | None = _field(None, "a local PEFT LoRA adapter folder (adapter_config.json, "
                                         "adapter_model.safetensors) the adapters start from")

    def __post_init__(self) -> None:
        _check_positive(
            "model",
            self,
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "intermediate_size",
            "max_position_embeddings",
            "rope_theta",
            "rms_norm_eps",
        )
        require(
            self.num_heads % self.num_kv_heads == 0,
            f"model.num_heads ({self.num_heads}) must be divisible by model.num_kv_heads "
            f"({self.num_kv_heads}): grouped-query attention shares each kv head among "
            "num_heads / num_kv_heads query heads",
        )
        if self.head_dim is None:
            require(
                self.hidden_size % self.num_heads == 0,
                f"model.hidden_size ({self.hidden_size}) must be divisible by model.num_heads "
                f"({self.num_heads}) when model.head_dim is not set: set model.head_dim explicitly",
            )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        _check_positive("model", self, "head_dim")
        if self.family in ("qwen3", "qwen3_moe"):
            require(self.qk_norm, f"model.family={self.family} has per-head q/k RMSNorm: set model.qk_norm=true")
        require(self.num_experts >= 0, f"model.num_experts must be >= 0 (0: a dense MLP), got {self.num_experts}")
        require((self.family == "qwen3_moe") == (self.num_experts > 0),
                f"model.family={self.family} with model.num_experts={self.num_experts}: mixture-of-experts layers "
                "are Qwen3-MoE's (family qwen3_moe with num_experts > 0; any other family has num_experts 0)")
        if self.num_experts:
            require(1 <= self.num_experts_per_tok <= self.num_experts,
                    f"model.num_experts_per_tok={self.num_experts_per_tok} must be in [1, model.num_experts="
                    f"{self.num_experts}]")
            if self.moe_intermediate_size is None:
                object.__setattr__(self, "moe_intermediate_size", self.intermediate_size)
            _check_positive("model", self, "moe_intermediate_size")
        require(self.lora_rank >= 0, f"model.lora_rank must be >= 0 (0: no adapters), got {self.lora_rank}")
        object.__setattr__(self, "lora_targets", tuple(self.lora_targets))
        if self.lora_rank:
            unknown = [t for t in self.lora_targets if t not in LORA_TARGETS]
            require(not unknown and len(self.lora_targets) > 0,
                    f"model.lora_targets={list(self.lora_targets)}: unknown {unknown or 'empty list'}; choose among "
                    f"{list(LORA_TARGETS)}")
            require(self.lora_alpha > 0, f"model.lora_alpha must be > 0, got {self.lora_alpha}")
            mlp = [t for t in self.lora_targets if t in ("gate_proj", "up_proj", "down_proj")]
            require(not (self.num_experts and mlp),
                    f"model.lora_targets {mlp} adapt MLP projections, which a mixture-of-experts model has per "
                    "expert: adapters on experts are not supported; set model.lora_targets=[q_proj,k_proj,v_proj,"
                    "o_proj]")
            require(0.0 <= self.lora_dropout < 1.0,
                    f"model.lora_dropout={self.lora_dropout} must be in [0, 1) (a probability of dropping)")
        require(self.lora_dropout == 0.0 or self.lora_rank > 0,
                f"model.lora_dropout={self.lora_dropout} but model.lora_rank=0: dropout applies to LoRA adapters; "
                "set model.lora_rank or model.lora_dropout=0")
        require(self.lora_path is None or self.lora_rank > 0,
                "model.lora_path is set but model.lora_rank=0: set model.lora_rank to the adapter's rank")


@dataclass(frozen=True)
class PoolChange(_Node):
    """Devices that leave or join the pool at the start of `step` (a preemptible cluster's schedule)."""

    step: int
    leave: tuple[int, ...] = ()
    join: tuple[int, ...] = ()
    notice: int = _field(0, "steps before `step` that a leave is announced (a preemption notice): the "
                            "controller plans and compiles the move off the leaving devices meanwhile")
    fail: tuple[int, ...] = _field((), "devices that fail abruptly during `step` (fault injection, after "
                                       "generation): the job recovers from the surviving units, else from the "
                                       "last checkpoint")


@dataclass(frozen=True)
class ClusterConfig(_Node):
    """The devices the job runs on and how the pool changes over time."""

    platform: Literal["cpu", "gpu", "tpu"] = "cpu"
    num_devices: int = 8
    device_memory_bytes: int | None = _field(None, "per-device memory-ledger cap; null = the hardware's")
    hardware: str = _field("cpu", "cost-model hardware table entry: cpu, h100, h200, a100, mi250x")
    schedule: tuple[PoolChange, ...] = _field((), "device-pool changes, in step order")

    def __post_init__(self) -> None:
        _check_positive("cluster", self, "num_devices")
        if self.device_memory_bytes is not None:
            _check_positive("cluster", self, "device_memory_bytes")
        _check_schedule(self.schedule, self.num_devices)


@dataclass(frozen=True)
class StageLayoutConfig(_Node):
    """One model-stage's parallel layout: tensor, pipeline and expert degree, and number of data-parallel
    replicas."""

    tp: int = 1
    pp: int = 1
    ep: int = _field(1, "expert-parallel degree (mixture-of-experts models): the experts split over ep devices "
                     "of a replica; must divide model.num_experts")
    dp: int | None = _field(None, "replica count; null = fill the devices the plan gives this stage")

    def devices_needed(self) -> int:
        """The fewest devices this layout occupies (dp unset counts one replica)."""
        return self.tp * self.pp * self.ep * (self.dp or 1)


@dataclass(frozen=True)
class PlanConfig(_Node):
    """The initial execution plan: per model-stage layouts, colocated on all devices or split."""

    colocate: bool = _field(True, "all model-stages share all devices (true) or get split device sets")
    park_idle: bool = _field(False, "offload idle model-stages' state to host memory between their uses")
    shard_optimizer: bool = _field(
        True, "training stages with dp > 1 keep 1/dp of the optimizer state on each replica (ZeRO-1); the "
        "parameters stay whole on every replica")
    share_frozen_base: bool = _field(
        True, "with LoRA: model-stages whose units hold the frozen base identically (same devices, layout and "
        "dtype) share one copy of it")
    default: StageLayoutConfig = field(default_factory=StageLayoutConfig)
    stages: dict[str, StageLayoutConfig] = field(
        default_factory=dict, metadata={"help": "per-stage layouts overriding plan.default"}
    )

    def __post_init__(self) -> None:
        names = stage_names()
        for name in self.stages:
            if name not in names:
                raise unknown_name_error("stage", f"plan.stages.{name}", name, names, "plan.stages")
        for key, layout in self.named_layouts():
            _check_at_least(key, layout, 1, "tp", "pp", "ep")
            if layout.dp is not None:
                _check_at_least(key, layout, 1, "dp")

    def layout_for(self, stage: str) -> StageLayoutConfig:
        """The layout of model-stage `stage`: its own entry, else `default`."""
        return self.stages.get(stage, self.default)

    def named_layouts(self) -> list[tuple[str, StageLayoutConfig]]:
        """(dotted key, layout) for `default` and every configured stage."""
        return [("plan.default", self.default)] + [(f"plan.stages.{n}", s) for n, s in self.stages.items()]


@dataclass(frozen=True)
class LengthStage(_Node):
    """From `step` on, responses are cut at `max_response_length` tokens (a staged length budget)."""

    step: int
    max_response_length: int


@dataclass(frozen=True)
class TaskStage(_Node):
    """From `step` on, the built-in task draws problems of `num_digits` (a difficulty curriculum)."""

    step: int
    num_digits: int


@dataclass(frozen=True)
class RolloutConfig(_Node):
    """Generation: lengths, samples per prompt and sampling parameters."""

    max_prompt_length: int = 32
    max_response_length: int = 32
    samples_per_prompt: int = 1
    temperature: float = _field(1.0, "0 = greedy")
    top_k: int = _field(0, "0 = off")
    top_p: float = _field(1.0, "1.0 = off")
    max_concurrent_decodes: int = _field(32, "decode slots per engine replica")
    decode_steps_per_call: int = _field(
        1, "decode steps per engine call (one dispatch per k tokens; same tokens as 1, but slots refill and "
        "weight swaps land only between calls)")
    seed: int = 0
    partial: Literal["finish", "resume"] = _field(
        "finish", "async: a weight sync landing while responses are generating: 'finish' them with the old "
        "policy (the sync takes effect at the next batch) or 'resume' them with the new one from the next "
        "decode step (their tokens carry both versions)")
    length_schedule: tuple[LengthStage, ...] = _field(
        (), "staged response budget (DeepScaleR-style), e.g. [{step: 0, max_response_length: 64}, {step: 50, "
            "max_response_length: 256}]; each <= rollout.max_response_length, which sizes the programs")
    page_size: int | None = _field(
        None, "paged KV cache: tokens per page (pages are taken as a sequence grows, freed when it ends); null: "
              "every decode slot reserves max_prompt_length + max_response_length")
    kv_cache_bytes: int | None = _field(
        None, "paged: the KV page pool of one actor-gen replica in bytes (admission waits for free pages); "
              "null: every slot's full length")
    max_turns: int = _field(4, "with task.env: assistant turns per trajectory at most (the environment's "
                               "answers between them); the whole trajectory fits in max_response_length tokens")
    max_total_length: int | None = _field(
        None, "with task.env: prompt + trajectory tokens at most; null: max_prompt_length + max_response_length")
    tool_timeout: float = _field(10.0, "with task.env: seconds one tool call may take; a slower one is stopped and "
                                       "answered with a timeout message")
    turn_cache: Literal["keep", "reprefill"] = _field(
        "keep", "with task.env: a conversation's KV cache while its tool runs: 'keep' it in its decode slot and "
                "prefill only the new tokens there (contiguous caches; a paged engine re-prefills), or "
                "'reprefill' the whole conversation")

    def __post_init__(self) -> None:
        _check_length_schedule(self.length_schedule, self.max_response_length)
        _check_positive("rollout", self, "max_turns", "tool_timeout")
        if self.max_total_length is not None:
            require(self.max_prompt_length < self.max_total_length <= self.max_prompt_length + self.max_response_length,
                    f"rollout.max_total_length={self.max_total_length} must be in (max_prompt_length, "
                    "max_prompt_length + max_response_length]: the trajectory lives in the response's "
                    f"{self.max_response_length} columns; raise rollout.max_response_length or lower it")
        if self.kv_cache_bytes is not None:
            require(self.page_size is not None, "rollout.kv_cache_bytes sizes a paged KV pool: set rollout.page_size")
            _check_positive("rollout", self, "kv_cache_bytes")
        if self.page_size is not None:
            _check_positive("rollout", self, "page_size")
        _check_positive(
            "rollout",
            self,
            "max_prompt_length",
            "max_response_length",
            "samples_per_prompt",
            "max_concurrent_decodes",
            "decode_steps_per_call",
        )
        _check_at_least("rollout", self, 0, "temperature", "top_k")
        require(0 < self.top_p <= 1, f"rollout.top_p must be in (0, 1], got {self.top_p}")


@dataclass(frozen=True)
class AlgorithmConfig(_Node):
    """The RL algorithm: advantage estimator, policy loss (clipping, aggregation), KL regularisation, DAPO's
    sampling and reward shaping, and the rollout/train mismatch correction. A null key takes the algorithm's
    published default (the registry nereus_jax.rl.algorithms.ALGORITHMS)."""

    name: Literal["ppo", "grpo", "remax", "rloo", "dapo", "dr_grpo", "gspo"] = "ppo"
    gamma: float = 1.0
    lam: float = _field(0.95, "GAE lambda (ppo)")
    clip_ratio: float = _field(0.2, "PPO clip epsilon, both sides (the default of clip_ratio_low/high)")
    clip_ratio_low: float | None = _field(
        None, "ratio clipped below at 1 - clip_ratio_low; null: dapo 0.2, gspo 3e-4, others clip_ratio")
    clip_ratio_high: float | None = _field(
        None, "ratio clipped above at 1 + clip_ratio_high; null: dapo 0.28 (clip-higher), gspo 4e-4, others clip_ratio")
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] | None = _field(
        None, "per-token losses to one loss (verl's loss_agg_mode): token-mean (DAPO), seq-mean-token-mean (the "
              "GRPO paper), seq-mean-token-sum-norm (Dr.GRPO: token sums over max_response_length); null: dr_grpo "
              "seq-mean-token-sum-norm, gspo seq-mean-token-mean, others token-mean")
    value_clip: float = _field(0.2, "critic value clipping (ppo)")
    kl_coef: float = 0.01
    kl_estimator: Literal["k1", "k3"] = "k1"
    kl_in_reward: bool = _field(True, "KL penalty folded into the reward (true) or added to the loss")
    entropy_coef: float = 0.0
    dynamic_sampling: bool | None = _field(
        None, "drop prompts whose samples' rewards are all equal and generate more prompts until the batch is "
              "full (DAPO; trainer.mode=sync); null: on for dapo")
    dynamic_sampling_max_rounds: int = _field(
        4, "dynamic sampling: extra generation rounds per step at most (verl: max_num_gen_batches - 1); a batch "
           "still short then is filled with dropped prompts, masked out of the loss")
    overlong_buffer: int | None = _field(
        None, "DAPO's soft overlong penalty: the last this many tokens before rollout.max_response_length, where "
              "the reward falls linearly to -overlong_penalty (0 = off); null: dapo a fifth of the budget, others 0")
    overlong_penalty: float = _field(1.0, "the soft overlong penalty at rollout.max_response_length")
    rollout_correction: Literal["none", "tis", "icepop"] = _field(
        "none", "rollout vs train mismatch, per token on r = pi_old / pi_engine: tis weights the loss by "
                "min(r, correction_clip), icepop by r inside [correction_low, correction_clip] and masks the rest")
    correction_clip: float | None = _field(None, "tis: the weight cap; icepop: the upper bound; null: tis 2, icepop 5")
    correction_low: float = _field(0.5, "icepop: the lower bound (also the band of mismatch_outside_fraction)")
    router_aux_coef: float = _field(
        0.0, "mixture-of-experts models: the load-balancing loss (transformers' load_balancing_loss_func, per "
             "training micro-batch) added to the actor loss times this (Qwen3-MoE checkpoints train with 0.001); "
             "0 = off; needs trainer.pipeline_schedule=gpipe. Logged as router_aux_loss")
    routing_replay: bool = _field(
        False, "mixture-of-experts models: actor-infer and actor-train route every token to the experts the engine "
               "chose for it (recorded at generation) instead of their own top-k; the gate weights stay the trained "
               "router's softmax at those experts. router_mismatch_fraction is logged either way")

    def __post_init__(self) -> None:
        for name in ("gamma", "lam"):
            value = getattr(self, name)
            require(0 <= value <= 1, f"algorithm.{name} must be in [0, 1], got {value}")
        _check_positive("algorithm", self, "clip_ratio", "correction_low")
        _check_at_least("algorithm", self, 0, "value_clip", "kl_coef", "dynamic_sampling_max_rounds",
                        "overlong_penalty", "router_aux_coef")
        for name in ("clip_ratio_low", "clip_ratio_high", "overlong_buffer"):
            if getattr(self, name) is not None:
                _check_at_least("algorithm", self, 0, name)
        if self.clip_ratio_low is not None:
            require(self.clip_ratio_low < 1, f"algorithm.clip_ratio_low must be < 1 (the ratio's lower clip "
                                             f"1 - clip_ratio_low must stay positive), got {self.clip_ratio_low}")
        if self.correction_clip is not None:
            require(self.correction_clip > self.correction_low,
                    f"algorithm.correction_clip ({self.correction_clip}) must exceed algorithm.correction_low "
                    f"({self.correction_low}): they bound the band of accepted ratios")


@dataclass(frozen=True)
class TrainerConfig(_Node):
    """The training loop: steps, batch, learning rates, sync or async rollouts."""

    steps: int = 20
    prompts_per_step: int = 32
    micro_batch_tokens: int | None = _field(
        None, "token budget per scoring/training micro-batch; null: the largest of 4096, 2048, ... (down to one "
              "row) whose predicted peak memory fits the devices under the starting plan")
    vocab_chunk: int = _field(
        DEFAULT_VOCAB_CHUNK, "vocabulary chunk of the output head in scoring and training: log-probs, entropy and "
                             "their gradient run over chunks of about this many ids with a running log-sum-exp, so "
                             "no call holds tokens x vocab logits (0 = the whole logits tensor at once)")
    actor_lr: float = 1e-5
    critic_lr: float = 1e-5
    mini_batches: int = _field(
        1, "optimizer updates per pass over a rollout batch (verl: batch size / ppo_mini_batch_size); the rows "
           "(prompts_per_step x samples_per_prompt) split into this many equal mini-batches, in order")
    ppo_epochs: int = _field(1, "passes over each rollout batch (verl: ppo_epochs); updates = mini_batches x this")
    packing: bool = _field(
        False, "pack sequences end to end (segment ids, positions restart) in rows of prompt + response length for "
               "every scoring and training forward, instead of padding each (verl: use_remove_padding)")
    pipeline_schedule: Literal["1f1b", "gpipe"] = _field(
        "1f1b", "training schedule of a model-stage whose layout has pp > 1: '1f1b' (one forward, one backward per "
                "tick: at most 2 pp - 1 micro-batches' stage inputs and one micro-batch's activations held, one extra "
                "forward per micro-batch) or 'gpipe' (the pipelined forward differentiated: every micro-batch's "
                "activations held); scoring runs the GPipe forward either way, generation stays pp = 1")
    mode: Literal["sync", "async"] = "sync"
    max_staleness: int = _field(1, "async: how many policy versions a rollout may lag (1 = one-step-off)")
    sync_every: int = _field(1, "async: learner updates between weight syncs to actor-gen (<= max_staleness + 1)")
    stale_rollouts: Literal["drop", "reweight"] = _field(
        "reweight", "async: rows generated by an older policy: 'reweight' them by the truncated importance "
        "ratio against the behaviour policy's log-probs and drop none, or 'drop' (mask out, counted) the rows "
        "staler than max_staleness and keep the rest unweighted")
    importance_clip: float = _field(2.0, "async, reweight: upper bound of the per-token importance weight")
    max_nonfinite_steps: int = _field(
        3, "a step whose scores (actor/ref log-probs, critic values) or loss, gradient norm or update are not "
           "finite applies no such update and writes no checkpoint; this many in a row stop the job, naming the "
           "newest checkpoint from before the update the streak started from (or saying none exists)")
    seed: int = 0
    warmup_sft_steps: int = _field(0, "supervised steps before RL, at most (cached on disk, reused next time)")
    warmup_target_accuracy: float = _field(
        0.0, "stop the warm start once accuracy on a validation split reaches this (0 = run all steps)")
    warmup_tool_fraction: float = _field(
        0.0, "task.env=calculator, plain format: this fraction of warm-start examples demonstrate a calculator call "
             "('[calculator: 12+34][result: 46]46', the result not trained on) instead of the direct answer")
    sft_lr: float = _field(3e-3, "learning rate of the supervised warm start")
    sft_batch: int = _field(64, "problems per supervised warm-start step")
    sft_control: bool = _field(True, "after RL, also run the supervised phase for the same wall time (information)")

    def __post_init__(self) -> None:
        _check_positive("trainer", self, "prompts_per_step", "sft_batch")
        if self.micro_batch_tokens is not None:
            _check_positive("trainer", self, "micro_batch_tokens")
        names = ("steps", "actor_lr", "critic_lr", "max_staleness", "warmup_sft_steps", "sft_lr",
                 "warmup_target_accuracy")
        _check_at_least("trainer", self, 0, *names, "vocab_chunk")
        require(0 <= self.warmup_tool_fraction <= 1,
                f"trainer.warmup_tool_fraction must be in [0, 1], got {self.warmup_tool_fraction}")
        _check_positive("trainer", self, "sync_every", "importance_clip", "max_nonfinite_steps", "mini_batches",
                        "ppo_epochs")
        require(self.sync_every <= self.max_staleness + 1,
                f"trainer.sync_every ({self.sync_every}) must be <= trainer.max_staleness + 1 "
                f"({self.max_staleness + 1}): a rollout would wait for a policy version no sync delivers")


@dataclass(frozen=True)
class TaskConfig(_Node):
    """The prompts and their verifiable reward."""

    name: Literal["addition", "sorting", "countdown", "copy", "file"] = "addition"
    prompt_file: str | None = _field(None, "task.name=file: prompts with reference answers, JSONL or Parquet")
    prompt_key: str = _field("prompt", "a row's prompt field (dotted path allowed): a string or a list of chat "
                                       "messages {role, content}")
    answer_key: str = _field("answer", "a row's reference-answer field (dotted path allowed, e.g. "
                                       "reward_model.ground_truth)")
    eval_file: str | None = _field(None, "held-out prompts (same format); null: the last task.eval_size rows of "
                                         "task.prompt_file are held out")
    system_prompt: str | None = _field(None, "a system message put before every prompt")
    chat_template: bool | None = _field(
        None, "render prompts with the tokenizer's chat template (add_generation_prompt); null: when it has one")
    overlong: Literal["drop", "error"] = _field(
        "drop", "prompts longer than rollout.max_prompt_length tokens: 'drop' them (counted, logged) or 'error'")
    reward: Literal["exact", "math", "python"] = _field(
        "exact", "exact: response equals the answer; math: the final answer (\\boxed{}, '#### N' or the last "
                 "number) is equivalent to it (math-verify); python: task.reward_fn")
    reward_fn: str | None = _field(None, "task.reward=python: 'package.module:function', called as "
                                         "fn(prompt, response, answer) -> float")
    reward_timeout: float = _field(10.0, "seconds a reward call (math or python) may take; slower calls score 0")
    tokenizer_path: str | None = _field(None, "a local tokenizer.json (or its folder); null: model.hf_path's, else "
                                              "the built-in character tokenizer")
    reward_model_path: str | None = _field(
        None, "a local Hugging Face *ForSequenceClassification checkpoint scoring responses (reward-infer) "
              "instead of the task's verifiable reward; it must share the actor's tokenizer")
    eval_size: int = 256
    eval_samples: int = _field(1, "k > 1: also report sampled pass@k on the held-out prompts before and after RL")
    num_digits: int = 2
    schedule: tuple[TaskStage, ...] = _field(
        (), "difficulty curriculum of a built-in task, e.g. [{step: 0, num_digits: 4}, {step: 40, num_digits: 16}]: "
            "problems of step s use the last entry at or before s (held-out evaluation: task.num_digits)")
    env: str | None = _field(
        None, "multi-turn rollouts with an environment: 'calculator' or 'python' (that tool), 'tools' (task.tools), "
              "or 'package.module:Class' (nereus_jax.rl.env's protocol); null: one response per prompt")
    tools: tuple[str, ...] = _field(("calculator",), "task.env=tools: the built-in tools offered (calculator, python)")
    tool_format: Literal["hermes", "llama3", "plain"] | None = _field(
        None, "how the model writes tool calls: hermes (Qwen3: <tool_call>{json}</tool_call>), llama3 (a JSON "
              "object), plain ([calculator: 12*34], for the character tokenizer); null: hermes with a chat "
              "template, else plain")

    def __post_init__(self) -> None:
        require(self.env is None or bool(self.env), "task.env is empty: name an environment or set it to null")
        _check_at_least("task", self, 0, "eval_size")
        _check_positive("task", self, "num_digits", "eval_samples", "reward_timeout")
        _check_stages("task.schedule", self.schedule)
        require(not self.schedule or self.name != "file",
                "task.schedule stages a built-in task's num_digits; task.name=file has none: remove task.schedule")
        for i, stage in enumerate(self.schedule):
            require(stage.num_digits > 0, f"task.schedule[{i}].num_digits must be > 0, got {stage.num_digits}")
        require(
            self.name != "file" or self.prompt_file is not None,
            "task.name is 'file' but task.prompt_file is not set: add task.prompt_file=path/to/prompts.jsonl",
        )
        require(
            self.reward != "python" or self.reward_fn is not None,
            "task.reward is 'python' but task.reward_fn is not set: add task.reward_fn=package.module:function",
        )
        require(
            self.reward_fn is None or self.reward_fn.count(":") == 1,
            f"task.reward_fn={self.reward_fn!r}: expected 'package.module:function'",
        )
        for key in ("prompt_key", "answer_key"):
            value = getattr(self, key)
            require(bool(value) and "" not in value.split("."),
                    f"task.{key}={value!r}: expected a field name or a dotted path like reward_model.ground_truth")


@dataclass(frozen=True)
class ControllerConfig(_Node):
    """When the job re-plans its layout while it runs."""

    enabled: bool = True
    gamma: float = _field(0.5, "admit a transition when its cost / per-step saving <= gamma * H (Eq. 2)")
    length_drift: float = _field(0.3, "relative sequence-length change that triggers a re-plan")
    memory_headroom: float = _field(0.1, "fraction of device memory a new plan leaves free; the memory trigger fires "
                                    "when the current plan's predicted peak leaves less than half of it")
    error_margin: bool = _field(True, "admit a move only if its predicted gain exceeds one standard deviation of "
                                      "the calibrated cost model's uncertainty about it (false: Eq. 2 as the paper "
                                      "has it)")
    hardware: str | None = _field(None, "cost-model hardware; null = cluster.hardware")

    def __post_init__(self) -> None:
        _check_at_least("controller", self, 0, "gamma")
        _check_positive("controller", self, "length_drift")
        require(
            0 <= self.memory_headroom < 1,
            f"controller.memory_headroom must be in [0, 1), got {self.memory_headroom}",
        )


@dataclass(frozen=True)
class CheckpointConfig(_Node):
    """Where and how often to checkpoint, and what to resume from."""

    dir: str | None = None
    every_steps: int = 0
    keep: int = 2
    resume_from: str | None = None
    export_hf: bool = _field(False, "also write the actor as a Hugging Face checkpoint with every checkpoint "
                                    "(<step>/hf); the run's end always writes RUN_DIR/hf")
    strict_resume: bool = _field(False, "a damaged newest checkpoint (unreadable, or an array not matching its "
                                        "checksum) stops the resume instead of falling back to the one before")

    def __post_init__(self) -> None:
        _check_at_least("checkpoint", self, 0, "every_steps")
        _check_positive("checkpoint", self, "keep")


@dataclass(frozen=True)
class LoggingConfig(_Node):
    """Metrics (JSONL, TensorBoard, Weights & Biases) and the progress display."""

    run_dir: str | None = None
    cache_dir: str | None = _field(None, "cache of warm starts and compilations; null = <run_dir>/../cache")
    tensorboard: bool = _field(True, "each step's scalars as TensorBoard events in <run_dir>/tensorboard "
                                     "(needs tensorboardX)")
    wandb: bool = _field(False, "log the same scalars, the config and the summary to a Weights & Biases run "
                                "(needs the wandb package: pip install 'nereus-jax[wandb]')")
    wandb_project: str = _field("nereus_jax", "the W&B project the run goes to")
    wandb_mode: Literal["online", "offline", "disabled"] | None = _field(
        None, "wandb.init's mode; null = wandb's own choice (WANDB_MODE, else online); offline: files only, "
              "`wandb sync` uploads them later")
    progress: bool = True
    log_every: int = 1

    def __post_init__(self) -> None:
        _check_positive("logging", self, "log_every")
        bad = sorted(set(self.wandb_project) & set(_WANDB_PROJECT_FORBIDS))
        require(bool(self.wandb_project.strip()) and len(self.wandb_project) <= 128 and not bad,
                f"logging.wandb_project={self.wandb_project!r} is not a W&B project name: 1 to 128 characters, "
                f"none of {' '.join(_WANDB_PROJECT_FORBIDS)}" + (f" (it has {' '.join(bad)})" if bad else ""))


@dataclass(frozen=True)
class Config(_Node):
    """A whole job. Each section validates itself; this checks the combinations across sections."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def __post_init__(self) -> None:
        _check_plan_fits(self.plan, self.cluster)
        _check_expert_layouts(self.plan, self.model)
        _check_context_fits(self.rollout, self.model)
        _check_group_sampling(self.algorithm, self.rollout)
        _check_mini_batches(self.trainer, self.rollout, self.algorithm)
        _check_routing(self)

    def records_routes(self) -> bool:
        """Whether actor-gen's engines record every token's routes (mixture-of-experts models with one response
        per prompt): for ``router_mismatch_fraction`` and ``algorithm.routing_replay``."""
        return bool(self.model.num_experts) and self.task.env is None


# --------------------------------------------------------------------------------------------- validation
def _check_positive(section: str, obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        require(value > 0, f"{section}.{name} must be > 0, got {value!r}")


def _check_at_least(section: str, obj: Any, minimum: float, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        require(value >= minimum, f"{section}.{name} must be >= {minimum}, got {value!r}")


def _check_length_schedule(schedule: Sequence[LengthStage], limit: int) -> None:
    _check_stages("rollout.length_schedule", schedule)
    for i, stage in enumerate(schedule):
        require(0 < stage.max_response_length <= limit,
                f"rollout.length_schedule[{i}].max_response_length ({stage.max_response_length}) must be in "
                f"[1, rollout.max_response_length={limit}]: raise rollout.max_response_length to the schedule's "
                "largest budget (it sizes the programs and the KV cache)")


def _check_stages(key: str, stages: Sequence[Any]) -> None:
    for i, stage in enumerate(stages):
        require(stage.step >= 0 and (i == 0 or stage.step > stages[i - 1].step),
                f"{key}[{i}].step ({stage.step}) must be >= 0 and after the previous entry's: list stages in "
                "step order")


def stage_at(stages: Sequence[Any], step: int, default: Any = None) -> Any:
    """The last stage of a step-ordered schedule starting at or before ``step`` (``default`` before the first)."""
    current = default
    for stage in stages:
        if stage.step > step:
            break
        current = stage
    return current


def _check_schedule(schedule: Sequence[PoolChange], num_devices: int) -> None:
    previous, present = 0, set(range(num_devices))
    for i, change in enumerate(schedule):
        key = f"cluster.schedule[{i}]"
        require(
            change.step >= previous,
            f"{key}.step ({change.step}) must be >= 0 and not before the previous change's step "
            f"({previous}): list pool changes in step order",
        )
        previous = change.step
        require(0 <= change.notice <= change.step,
                f"{key}.notice ({change.notice}) must be in [0, step={change.step}]: a leave is announced "
                "at most `step` steps ahead")
        for kind in ("leave", "join", "fail"):
            for device in getattr(change, kind):
                require(
                    0 <= device < num_devices,
                    f"{key}.{kind}: device id {device} is outside [0, {num_devices}): ids index the "
                    f"cluster.num_devices ({num_devices}) devices",
                )
        present = (present - set(change.leave) - set(change.fail)) | set(change.join)
        require(
            bool(present),
            f"{key} leaves no device in the pool at step {change.step} (leave/fail remove every one of the "
            f"cluster.num_devices={num_devices} devices): keep at least one device, or join some at that step",
        )


def _check_plan_fits(plan: PlanConfig, cluster: ClusterConfig) -> None:
    for key, layout in plan.named_layouts():
        need = layout.devices_needed()
        require(
            need <= cluster.num_devices,
            f"{key} needs tp*pp*ep*dp = {layout.tp}*{layout.pp}*{layout.ep}*{layout.dp or 1} = {need} devices but "
            f"cluster.num_devices is {cluster.num_devices}: lower {key}.tp/pp/ep/dp or raise "
            "cluster.num_devices",
        )


def _check_expert_layouts(plan: PlanConfig, model: ModelConfig) -> None:
    """ep > 1 needs experts it divides, and pp = 1 (sharding/experts.py: not inside a pipeline stage)."""
    for key, layout in plan.named_layouts():
        if layout.ep == 1:
            continue
        require(bool(model.num_experts), f"{key}.ep={layout.ep}: expert parallelism needs a mixture-of-experts "
                f"model, but model.family={model.family} has model.num_experts=0; set {key}.ep=1")
        require(model.num_experts % layout.ep == 0, f"{key}.ep={layout.ep} does not divide model.num_experts="
                f"{model.num_experts}: choose an ep dividing {model.num_experts}")
        require(layout.pp == 1, f"{key}.ep={layout.ep} with {key}.pp={layout.pp}: expert parallelism does not run "
                "inside a pipeline yet; set pp=1 or ep=1")


def _check_context_fits(rollout: RolloutConfig, model: ModelConfig) -> None:
    total = rollout.max_prompt_length + rollout.max_response_length
    require(
        total <= model.max_position_embeddings,
        f"rollout.max_prompt_length ({rollout.max_prompt_length}) + rollout.max_response_length "
        f"({rollout.max_response_length}) = {total} exceeds model.max_position_embeddings "
        f"({model.max_position_embeddings}): shorten the rollout or use a longer-context model",
    )


def _check_group_sampling(algorithm: AlgorithmConfig, rollout: RolloutConfig) -> None:
    require(
        algorithm.name not in _GROUP_ALGORITHMS or rollout.samples_per_prompt >= 2,
        f"algorithm.name={algorithm.name} needs rollout.samples_per_prompt >= 2 (got "
        f"{rollout.samples_per_prompt}): its baseline compares the samples of one prompt",
    )
    require(
        algorithm.dynamic_sampling is not True or rollout.samples_per_prompt >= 2,
        f"algorithm.dynamic_sampling=true needs rollout.samples_per_prompt >= 2 (got {rollout.samples_per_prompt}): "
        "it keeps the prompts whose samples' rewards differ",
    )


def _check_routing(cfg: Config) -> None:
    """The mixture-of-experts training options need experts, and what they run on must carry routes."""
    a = cfg.algorithm
    used = [k for k, on in (("router_aux_coef", a.router_aux_coef > 0), ("routing_replay", a.routing_replay)) if on]
    if not used:
        return
    keys = " and ".join(f"algorithm.{k}" for k in used)
    require(bool(cfg.model.num_experts), f"{keys} act on a mixture-of-experts model's router, but model.family="
            f"{cfg.model.family} has model.num_experts=0: unset them or use a Qwen3-MoE model")
    require(a.router_aux_coef == 0 or cfg.trainer.pipeline_schedule == "gpipe",
            "algorithm.router_aux_coef > 0 with trainer.pipeline_schedule=1f1b: the 1F1B schedule does not carry "
            "router statistics between pipeline stages yet; set trainer.pipeline_schedule=gpipe (it applies only to "
            "a training stage with pp > 1, which then runs GPipe, as the cost model prices it)")
    require(not a.routing_replay or cfg.task.env is None,
            f"algorithm.routing_replay with task.env={cfg.task.env!r}: multi-turn trajectories do not record their "
            "routes yet; unset algorithm.routing_replay or task.env")


def _check_mini_batches(trainer: TrainerConfig, rollout: RolloutConfig, algorithm: AlgorithmConfig) -> None:
    rows = trainer.prompts_per_step * rollout.samples_per_prompt
    require(
        rows % trainer.mini_batches == 0,
        f"trainer.mini_batches={trainer.mini_batches} does not divide the {rows} rollouts of a step "
        f"(trainer.prompts_per_step x rollout.samples_per_prompt): choose a divisor of {rows}",
    )
    dynamic = algorithm.name == "dapo" if algorithm.dynamic_sampling is None else algorithm.dynamic_sampling
    require(
        trainer.mode == "sync" or not dynamic,
        "algorithm dynamic sampling (dapo's default) generates more prompts inside the learner's step, but "
        "trainer.mode=async generates on a thread of its own: set algorithm.dynamic_sampling=false or "
        "trainer.mode=sync",
    )
    require(
        algorithm.rollout_correction == "none" or rollout.temperature == 1.0,
        f"algorithm.rollout_correction={algorithm.rollout_correction} compares the engine's log-probs with the "
        f"trainer's, but rollout.temperature={rollout.temperature} samples from a tempered distribution the "
        "trainer does not compute: use rollout.temperature=1.0 or algorithm.rollout_correction=none",
    )


_GROUP_ALGORITHMS = ("grpo", "rloo", "dapo", "dr_grpo", "gspo")


def _read_mapping(path: Path) -> dict[str, Any]:
    try:
        data = parse_yaml(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise ConfigError(f"cannot read config file {path}: {error.strerror}") from None
    except UnicodeDecodeError as error:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte {error.start}): give a YAML file") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"{path} is not valid YAML: {error}") from None
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path}: expected a mapping of keys at the top level, got {show(data)}")
    return dict(data)


def config_dir() -> Path:
    """The `configs/` directory: the installed package's copy if present, else the repository's."""
    packaged = Path(__file__).resolve().parent / "configs"
    return packaged if packaged.is_dir() else Path(__file__).resolve().parents[1] / "configs"


def available_models() -> list[str]:
    """Names of the model presets in `config_dir()/models`."""
    return sorted(p.stem for p in (config_dir() / "models").glob("*.yaml"))


def available_configs() -> list[str]:
    """Names of the job configs in `config_dir()`, loadable by bare name."""
    return sorted(p.stem for p in config_dir().glob("*.yaml"))


def _model_path(name: str) -> Path:
    folder = config_dir() / "models"
    names = available_models()
    if name not in names:
        close = difflib.get_close_matches(name, names, n=1)
        hint = f" — did you mean '{close[0]}'?" if close else ""
        raise ConfigError(
            f"unknown model preset '{name}'{hint} (available: {', '.join(names)}); to add one, "
            f"create {folder / (name + '.yaml')} with ModelConfig keys"
        )
    return folder / f"{name}.yaml"


def _preset_data(name: str) -> dict[str, Any]:
    """The raw keys of preset `name` (with `name` defaulting to it), checked on their own first."""
    path = _model_path(name)
    data = {"name": name, **_read_mapping(path)}
    try:
        from_dict(ModelConfig, data, "model")
    except ConfigError as error:
        raise ConfigError(f"{error} [in model preset {path}]") from None
    return data


def resolve_model(name: str) -> ModelConfig:
    """The ModelConfig of preset `name` (`config_dir()/models/<name>.yaml`)."""
    return from_dict(ModelConfig, _preset_data(name), "model")


def _merge(base: Mapping[str, Any], changes: Mapping[str, Any]) -> dict[str, Any]:
    """`base` with `changes` applied; nested mappings merge key by key."""
    merged = dict(base)
    for name, value in changes.items():
        both = isinstance(value, Mapping) and isinstance(merged.get(name), Mapping)
        merged[name] = _merge(merged[name], value) if both else value
    return merged


def _expand_model(data: Mapping[str, Any]) -> dict[str, Any]:
    """Replace `model: NAME` / `model: {preset: NAME, ...}` with the preset's keys plus the changes, and
    `model: {hf_path: DIR, ...}` with the checkpoint's architecture plus the changes (a preset is then
    ignored; a change that contradicts the checkpoint is an error naming both values)."""
    data = dict(data)
    model = data.get("model")
    if isinstance(model, str):
        model = {"preset": model}
    if model is not None and not isinstance(model, Mapping):
        names = ", ".join(available_models())
        raise ConfigError(
            f"model: expected a preset name ({names}) or a mapping of ModelConfig keys, got {show(model)}"
        )
    if isinstance(model, Mapping) and model.get("hf_path") is not None:
        data["model"] = _checkpoint_model(model)
    elif isinstance(model, Mapping) and "preset" in model:
        name = model["preset"]
        require(
            isinstance(name, str),
            f"model.preset: expected str (a file stem in {config_dir() / 'models'}), got {show(name)}",
        )
        changes = {k: v for k, v in model.items() if k != "preset"}
        data["model"] = _merge(_preset_data(name), changes)
    return data


def _checkpoint_model(model: Mapping[str, Any]) -> dict[str, Any]:
    """The model keys of `model.hf_path`'s config.json, plus the explicit keys of `model` that agree."""
    from nereus_jax.hf_config import ARCHITECTURE_KEYS, HFImportError, model_keys_from_hf, read_hf_config

    path = model["hf_path"]
    require(isinstance(path, str) and path != "", f"model.hf_path: expected a directory path, got {show(path)}")
    try:
        keys = model_keys_from_hf(read_hf_config(path))
    except HFImportError as e:
        raise ConfigError(f"model.hf_path={path!r}: {e}") from None
    explicit = {k: v for k, v in model.items() if k != "preset"}
    for key in ARCHITECTURE_KEYS:
        if key in explicit and explicit[key] is not None and not _same_value(explicit[key], keys[key]):
            raise ConfigError(
                f"model.{key}={_render(explicit[key])} contradicts the checkpoint model.hf_path={path!r}, whose "
                f"config.json gives {_render(keys[key])}: drop model.{key} (the checkpoint decides the "
                "architecture) or use another checkpoint")
    name = Path(path).resolve().name or "hf"
    return {"name": name, **keys, **{k: v for k, v in explicit.items() if k not in ARCHITECTURE_KEYS}}


def _same_value(given: Any, expected: Any) -> bool:
    """Config values compared as the tree would read them (1e-6 == 1.0e-6; mappings key by key)."""
    if isinstance(expected, Mapping) and isinstance(given, Mapping):
        return set(given) <= set(expected) and all(_same_value(v, expected[k]) for k, v in given.items())
    if isinstance(expected, bool) or isinstance(given, bool):
        return given is expected
    if isinstance(expected, int | float) and isinstance(given, int | float):
        return float(given) == float(expected)
    return given == expected


# ---------------------------------------------------------------------------------------------- overrides
def _parse_override(text: str) -> tuple[str, Any]:
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key or "" in key.split("."):
        example = "expected the form key.sub=value, like trainer.steps=5"
        raise ConfigError(f"malformed override {text!r}: {example}")
    try:
        return key, parse_yaml(raw)
    except yaml.YAMLError as error:
        raise ConfigError(f"override {text!r}: the value is not valid YAML ({error}); quote it") from None


def _set_key(data: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = data
    for depth, part in enumerate(parts[:-1]):
        child = node.get(part)
        if depth == 0 and part == "model" and isinstance(child, str):
            child = {"preset": child}
        if child is None:
            child = {}
        if not isinstance(child, Mapping):
            where = ".".join(parts[: depth + 1])
            raise ConfigError(f"cannot set '{key}': '{where}' is {show(child)}, not a section")
        node[part] = child = dict(child)
        node = child
    node[parts[-1]] = value


def apply_overrides(data: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """A copy of `data` with each `key.sub=value` applied; `model=` and `model.preset=` go first."""
    if isinstance(overrides, str):
        overrides = [overrides]
    result = copy.deepcopy(dict(data))
    parsed = [_parse_override(text) for text in overrides]
    for key, value in sorted(parsed, key=lambda kv: kv[0] not in _PRESET_KEYS):
        _set_key(result, key, value)
    return result


# ------------------------------------------------------------------------------------------------ loading
def config_from_dict(data: Mapping[str, Any]) -> Config:
    """The validated Config described by plain data (the inverse of `Config.to_dict`)."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"config: expected a mapping of sections, got {show(data)}")
    return from_dict(Config, _expand_model(data), "")


def _config_path(path: str | os.PathLike[str]) -> Path:
    candidate = Path(path)
    if candidate.is_file():
        return candidate
    text = os.fspath(path)
    if not text.endswith((".yaml", ".yml")) and len(candidate.parts) == 1:
        named = config_dir() / f"{text}.yaml"
        if named.is_file():
            return named
    raise ConfigError(
        f"config file '{text}' not found (a bare name such as 'default' is looked up in "
        f"{config_dir()}: {', '.join(available_configs())})"
    )


def load_config(path: str | os.PathLike[str] | None = None, overrides: Sequence[str] = ()) -> Config:
    """The Config in YAML file `path` (None: defaults; a bare name: configs/<name>.yaml) plus overrides."""
    data = _read_mapping(_config_path(path)) if path is not None else {}
    return config_from_dict(apply_overrides(data, overrides))


# ----------------------------------------------------------------------------------------------- describe
def describe(cls: type = Config, prefix: str = "") -> str:
    """Every key of the tree under `cls`, one line each: `  dotted.key: type = default  # help`."""
    return "\n".join(_describe_lines(cls, prefix))


def _describe_lines(cls: type, prefix: str) -> Iterator[str]:
    for f in dataclasses.fields(cls):
        tp, key = field_types(cls)[f.name], join(prefix, f.name)
        if dataclasses.is_dataclass(tp):
            if not prefix:
                yield f"{key}: {(tp.__doc__ or '').strip()}"
            yield from _describe_lines(tp, key)
            continue
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        shown = "(required)" if default is dataclasses.MISSING else _render(default)
        help_text = f"  # {f.metadata['help']}" if "help" in f.metadata else ""
        yield f"  {key}: {type_name(tp)} = {shown}{help_text}"
        yield from _describe_children(tp, key)


def _describe_children(tp: Any, key: str) -> Iterator[str]:
    """Keys inside an optional section, a mapping of sections or a list of sections."""
    args = [a for a in typing.get_args(tp) if a is not type(None) and a is not Ellipsis]
    if typing.get_origin(tp) is dict:
        yield from _describe_lines(args[1], f"{key}.<name>")
    elif len(args) == 1 and dataclasses.is_dataclass(args[0]):
        suffix = "[i]" if typing.get_origin(tp) in (tuple, list) else ""
        yield from _describe_lines(args[0], key + suffix)


def _render(value: Any) -> str:
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    if isinstance(value, (tuple, list, dict)):
        return json.dumps(to_plain(value))
    return str(value)
