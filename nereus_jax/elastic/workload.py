"""What the cost model needs to know about one RL step: how many sequences, and how long they are.

Lengths are summarised by mean, p95 and max. The max sets the memory (a KV cache slot and a micro-batch
row must hold the longest sequence). FLOPs follow the padded row length: with ``packed`` False every row
is padded to the longest sequence; with ``packed`` True (``trainer.packing``) sequences are packed end to end
and FLOPs follow the mean. ``from_lengths`` builds a Workload
from the lengths a step actually produced, so the controller can re-plan on the observed distribution.

    wl = Workload(prompts_per_step=512, prompt_length=LengthStats.fixed(512),
                  response_length=LengthStats.fixed(4096))
    wl.sequences            # 512 sequences scored and trained per step
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from nereus_jax.config import PIPELINE_SCHEDULES
from nereus_jax.rl.registry import algorithm_spec
from nereus_jax.vocab_chunks import DEFAULT_VOCAB_CHUNK


class WorkloadError(ValueError):
    """A workload that cannot describe a step (non-positive sizes, mean > p95 > max ordering broken)."""


@dataclass(frozen=True)
class LengthStats:
    """A length distribution in tokens: mean <= p95 <= max."""

    mean: float
    p95: float
    max: int

    def __post_init__(self) -> None:
        if not 0 < self.mean <= self.p95 <= self.max:
            raise WorkloadError(
                f"length stats need 0 < mean <= p95 <= max, got mean={self.mean}, p95={self.p95}, max={self.max}")

    @classmethod
    def fixed(cls, length: int) -> LengthStats:
        """Every sequence exactly ``length`` tokens."""
        return cls(float(length), float(length), int(length))

    @classmethod
    def of(cls, lengths: Sequence[int]) -> LengthStats:
        """Mean, 95th percentile (nearest rank) and max of observed lengths."""
        if not lengths:
            raise WorkloadError("no lengths to summarise")
        ordered = sorted(int(n) for n in lengths)
        rank = max(0, math.ceil(0.95 * len(ordered)) - 1)
        return cls(sum(ordered) / len(ordered), float(ordered[rank]), ordered[-1])

    def scaled(self, factor: float) -> LengthStats:
        """Every length times ``factor`` (at least 1 token)."""
        top = max(1, math.ceil(self.max * factor))
        return LengthStats(min(max(1.0, self.mean * factor), top), min(max(1.0, self.p95 * factor), top), top)


@dataclass(frozen=True)
class Workload:
    """One RL step: prompts, samples per prompt, prompt and response lengths.

    ``greedy_baseline`` adds one greedy generation per prompt (ReMax). ``sequences`` is what the scoring
    and training stages see; ``generated_sequences`` what actor-gen produces. ``packed``: see above.
    Training makes ``mini_batches`` x ``epochs`` optimizer updates a step (trainer.mini_batches,
    trainer.ppo_epochs), each on ``train_sequences``: the cost model prices each update's calls, optimizer
    step and gradient all-reduce, and a micro-batch divides one mini-batch. ``pipeline_schedule``
    (trainer.pipeline_schedule): how a training stage with pp > 1 runs, 1F1B or GPipe, which sets its
    activation memory and work per micro-batch. ``vocab_chunk`` (trainer.vocab_chunk): the output head's
    vocabulary chunk in scoring and training (0: whole logits), which sets its working set and its work.
    ``shard_optimizer`` (plan.shard_optimizer): a training stage's dp replicas each keep 1/dp of its optimizer
    state (ZeRO-1), which sets its resident bytes and adds an all-gather of the updated parameters.
    ``expert_load`` (mixture-of-experts models): the busiest expert's share of the step's routed token-expert
    pairs (0: balanced, 1 / num_experts each); with expert parallelism the device holding that expert computes
    its tokens, so it sets the expert layers' time on an ep group
    (``costs.counts.busiest_shard_share``). Dense models ignore it.
    """

    prompts_per_step: int
    prompt_length: LengthStats
    response_length: LengthStats
    samples_per_prompt: int = 1
    greedy_baseline: bool = False
    packed: bool = False
    mini_batches: int = 1
    epochs: int = 1
    pipeline_schedule: str = "1f1b"
    vocab_chunk: int = DEFAULT_VOCAB_CHUNK
    shard_optimizer: bool = False
    expert_load: float = 0.0

    def __post_init__(self) -> None:
        if not 0 <= self.expert_load <= 1:
            raise WorkloadError(f"workload.expert_load must be in [0, 1] (the busiest expert's share of routed "
                                f"tokens; 0: balanced), got {self.expert_load}")
        if self.pipeline_schedule not in PIPELINE_SCHEDULES:
            raise WorkloadError(f"workload.pipeline_schedule={self.pipeline_schedule!r}; valid: "
                                f"{', '.join(PIPELINE_SCHEDULES)}")
        for name in ("prompts_per_step", "samples_per_prompt", "mini_batches", "epochs"):
            if getattr(self, name) < 1:
                raise WorkloadError(f"workload.{name} must be >= 1, got {getattr(self, name)}")
        if self.vocab_chunk < 0:
            raise WorkloadError(f"workload.vocab_chunk must be >= 0 (0 = whole logits), got {self.vocab_chunk}")
        if self.sequences % self.mini_batches:
            raise WorkloadError(f"workload.mini_batches={self.mini_batches} does not divide the step's "
                                f"{self.sequences} sequences")

    @property
    def updates(self) -> int:
        """Optimizer updates per step of a training stage: mini-batches x epochs."""
        return self.mini_batches * self.epochs

    @property
    def train_sequences(self) -> int:
        """Sequences one optimizer update trains on (a mini-batch)."""
        return self.sequences // self.mini_batches

    @property
    def sequences(self) -> int:
        """Sequences scored and trained per step."""
        return self.prompts_per_step * self.samples_per_prompt

    @property
    def generated_sequences(self) -> int:
        """Sequences actor-gen decodes per step (ReMax adds a greedy one per prompt)."""
        return self.sequences + (self.prompts_per_step if self.greedy_baseline else 0)

    def rows_for(self, kind: str) -> int:
        """Sequences one run of a stage kind handles: gen all it decodes, train one update's, infer all."""
        return {"gen": self.generated_sequences, "train": self.train_sequences}.get(kind, self.sequences)

    @property
    def mean_tokens(self) -> float:
        """Mean prompt + response length."""
        return self.prompt_length.mean + self.response_length.mean

    @property
    def max_tokens(self) -> int:
        """Longest prompt + longest response: the context a KV slot or a micro-batch row must hold."""
        return self.prompt_length.max + self.response_length.max

    @property
    def head_tokens(self) -> float:
        """Positions of a scoring/training row the output head runs on: the response (a padded row's hidden
        states are cut to it first; the longest response sets the shape), or every position of a packed row
        (its mean)."""
        return self.mean_tokens if self.packed else float(self.response_length.max)

    def with_response_length(self, stats: LengthStats) -> Workload:
        """The same step with another response-length distribution (length drift)."""
        return replace(self, response_length=stats)

    def with_expert_load(self, share: float) -> Workload:
        """The same step with another busiest-expert share (expert-load drift)."""
        return replace(self, expert_load=share)

    @classmethod
    def fixed(cls, prompts: int, prompt_length: int, response_length: int, samples_per_prompt: int = 1,
              greedy_baseline: bool = False, packed: bool = False, mini_batches: int = 1,
              epochs: int = 1, pipeline_schedule: str = "1f1b", vocab_chunk: int = DEFAULT_VOCAB_CHUNK,
              shard_optimizer: bool = False, expert_load: float = 0.0) -> Workload:
        """Every prompt and every response of one length."""
        return cls(prompts, LengthStats.fixed(prompt_length), LengthStats.fixed(response_length),
                   samples_per_prompt, greedy_baseline, packed, mini_batches, epochs, pipeline_schedule, vocab_chunk,
                   shard_optimizer, expert_load)

    @classmethod
    def from_lengths(cls, prompt_lengths: Sequence[int], response_lengths: Sequence[int],
                     samples_per_prompt: int = 1, greedy_baseline: bool = False, packed: bool = False) -> Workload:
        """The workload of a step that produced these lengths (one prompt length per prompt, one response
        length per sampled sequence)."""
        if len(response_lengths) != len(prompt_lengths) * samples_per_prompt:
            raise WorkloadError(
                f"{len(response_lengths)} response lengths for {len(prompt_lengths)} prompts x "
                f"{samples_per_prompt} samples: expected {len(prompt_lengths) * samples_per_prompt}")
        return cls(len(prompt_lengths), LengthStats.of(prompt_lengths), LengthStats.of(response_lengths),
                   samples_per_prompt, greedy_baseline, packed)

    @classmethod
    def from_config(cls, config) -> Workload:
        """The worst case a job config allows: every prompt and response at its configured maximum."""
        greedy = algorithm_spec(config.algorithm.name).needs_greedy_baseline
        return cls.fixed(config.trainer.prompts_per_step, config.rollout.max_prompt_length,
                         config.rollout.max_response_length, config.rollout.samples_per_prompt, greedy,
                         packed=config.trainer.packing, mini_batches=config.trainer.mini_batches,
                         epochs=config.trainer.ppo_epochs, pipeline_schedule=config.trainer.pipeline_schedule,
                         vocab_chunk=config.trainer.vocab_chunk, shard_optimizer=config.plan.shard_optimizer)
