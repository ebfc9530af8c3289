"""How the output head splits a vocabulary into chunks (JAX-free: the model and the cost model both read it).

:func:`nereus_jax.models.vocab.head_logprobs` runs the output projection and the softmax over ``n``
chunks of the vocabulary; chunk ``c`` holds ids ``c, c + n, c + 2n, ...``. :func:`vocab_split` picks ``n``
and the chunk width for a target width (``trainer.vocab_chunk``); the memory model prices the same width.

    vocab_split(151936, 8192)   # (16, 151936): 16 chunks of 9,496 ids, no padding
"""

from __future__ import annotations

import functools
import math

DEFAULT_VOCAB_CHUNK = 8192  # trainer.vocab_chunk's default
_KEEP_TWOS = 8  # a chunk keeps this power of two of the vocabulary's (a tp of up to 8 splits every chunk evenly)


@functools.lru_cache(maxsize=256)  # the planner asks for the same few (vocabulary, chunk) pairs thousands of times
def vocab_split(vocab: int, chunk: int) -> tuple[int, int]:
    """(chunks n, padded vocabulary = n x chunk width) for a target width ``chunk`` (0 or >= vocab: one
    chunk). Prefers a width that divides the vocabulary and keeps its factor of two up to 8 (so a tp split
    of the vocabulary splits every chunk evenly), the closest such to ``chunk`` (in ratio) if it lies within
    a factor 4; otherwise pads the vocabulary to ceil(vocab / chunk) chunks."""
    if chunk <= 0 or vocab <= chunk:
        return 1, vocab
    twos = math.gcd(vocab, _KEEP_TWOS)
    widths = [vocab // n for n in range(2, vocab + 1) if vocab % n == 0 and (vocab // n) % twos == 0]
    width = min(widths, key=lambda w: abs(math.log(w / chunk)), default=0)
    if width and abs(math.log(width / chunk)) <= math.log(4):
        return vocab // width, vocab
    n = -(-vocab // chunk)
    width = -(-vocab // (n * twos)) * twos
    return n, n * width


def chunk_width(vocab: int, chunk: int) -> int:
    """Ids per chunk (padding included) of a ``vocab``-id head at target width ``chunk`` (0: the vocabulary)."""
    n, padded = vocab_split(vocab, chunk)
    return padded // n
