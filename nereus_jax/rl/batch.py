"""Rollout batches: prompts (left-padded) and responses (right-padded) as one token sequence per row.

Row layout of a sequence: ``[prompt padded on the left to P | response padded on the right to R]``, so
every response starts at column P. Logits at column ``P - 1 + t`` predict response token t, and a value
model's output there is the value of the state before token t.

A multi-turn trajectory (``task.env``) fills the response columns with every turn: the model's tokens and
the environment's (tool outputs, the chat template's turn markers) between them. ``response_mask_br`` marks
the model's own tokens (what the loss, KL and entropy count) and ``context_mask_br`` every real token (what
attention reads); single-turn batches have no ``context_mask_br`` (it equals ``response_mask_br``).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class RolloutBatch(NamedTuple):
    """What actor-gen hands to the scoring and training stages (host numpy arrays)."""

    prompt_bp: np.ndarray          # int32 [b, P], left-padded
    prompt_mask_bp: np.ndarray     # int32 [b, P]
    response_br: np.ndarray        # int32 [b, R], right-padded
    response_mask_br: np.ndarray   # int32 [b, R]
    behaviour_logp_br: np.ndarray  # float32 [b, R], log-probs of the sampled tokens under the generating policy
    prompt_index_b: np.ndarray     # int64 [b], data position of each row's prompt
    sample_index_b: np.ndarray     # int32 [b], which of the prompt's samples
    policy_version_b: np.ndarray   # int32 [b], parameter version that produced the row
    context_mask_br: np.ndarray | None = None  # int32 [b, R]: every real response token, the environment's too
    env_reward_b: np.ndarray | None = None  # float32 [b]: an environment's rewards, added to the task's
    # int16 [b, P + R, layers, k]: a mixture-of-experts engine's routes of every token it ran (the router's top-k
    # per layer; -1 on padding and on each response's last token, which generation never feeds back)
    routes_btlk: np.ndarray | None = None

    @property
    def prompt_len(self) -> int:
        return int(self.prompt_bp.shape[1])

    @property
    def context_mask(self) -> np.ndarray:
        """[b, R] the response columns attention reads (the model's and the environment's tokens)."""
        return self.response_mask_br if self.context_mask_br is None else self.context_mask_br

    def tokens(self) -> np.ndarray:
        return np.concatenate([self.prompt_bp, self.response_br], axis=1)

    def attention_mask(self) -> np.ndarray:
        return np.concatenate([self.prompt_mask_bp, self.context_mask], axis=1)

    def select(self, rows) -> RolloutBatch:
        return RolloutBatch(*(None if x is None else np.asarray(x)[rows] for x in self))

    @staticmethod
    def concatenate(batches) -> RolloutBatch:
        """Rows of ``batches`` one after another (a context mask where any has one)."""
        batches = list(batches)
        if any(b.context_mask_br is not None for b in batches):
            batches = [b._replace(context_mask_br=b.context_mask) for b in batches]
        if any(b.env_reward_b is not None for b in batches):
            batches = [b._replace(env_reward_b=np.zeros(len(b.response_br), np.float32) if b.env_reward_b is None
                                  else b.env_reward_b) for b in batches]
        return RolloutBatch(*(None if parts[0] is None else np.concatenate(parts)
                              for parts in zip(*batches, strict=True)))


def left_pad(seqs: list[list[int]], length: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Left-pads token lists to ``length``; a longer sequence is an error (callers check first)."""
    return _pad(seqs, length, pad_id, left=True)


def right_pad(seqs: list[list[int]], length: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Right-pads token lists to ``length``."""
    return _pad(seqs, length, pad_id, left=False)


def _pad(seqs: list[list[int]], length: int, pad_id: int, *, left: bool) -> tuple[np.ndarray, np.ndarray]:
    out = np.full((len(seqs), length), pad_id, np.int32)
    mask = np.zeros((len(seqs), length), np.int32)
    for i, s in enumerate(seqs):
        if len(s) > length:
            raise ValueError(f"sequence of {len(s)} tokens exceeds the padded length {length}")
        cols = slice(length - len(s), length) if left else slice(0, len(s))
        out[i, cols] = s
        mask[i, cols] = 1
    return out, mask
