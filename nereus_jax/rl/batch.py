"""Rollout batches: prompts (left-padded) and responses (right-padded) as one token sequence per row.

Row layout of a sequence: ``[prompt padded on the left to P | response padded on the right to R]``, so
every response starts at column P. Logits at column ``P - 1 + t`` predict response token t, and a value
model's output there is the value of the state before token t.
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

    @property
    def prompt_len(self) -> int:
        return int(self.prompt_bp.shape[1])

    def tokens(self) -> np.ndarray:
        return np.concatenate([self.prompt_bp, self.response_br], axis=1)

    def attention_mask(self) -> np.ndarray:
        return np.concatenate([self.prompt_mask_bp, self.response_mask_br], axis=1)

    def select(self, rows) -> RolloutBatch:
        return RolloutBatch(*(np.asarray(x)[rows] for x in self))


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
