"""Tokenizers for the job: a small character tokenizer for the built-in tasks, and Hugging Face
``tokenizer.json`` files through the ``tokenizers`` library for real models (local paths only)."""

from __future__ import annotations

import os
from typing import Protocol

CHARS = "0123456789+-*/=()<>[],.:;?! abcdefghijklmnopqrstuvwxyz"


class Tokenizer(Protocol):
    pad_id: int
    bos_id: int
    eos_id: int
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids) -> str: ...


class CharTokenizer:
    """One token per character of :data:`CHARS`; 0 = pad, 1 = bos, 2 = eos. Unknown characters are an error."""

    pad_id, bos_id, eos_id = 0, 1, 2

    def __init__(self, chars: str = CHARS):
        self._ids = {c: i + 3 for i, c in enumerate(chars)}
        self._chars = dict(enumerate(chars, start=3))
        self.vocab_size = len(chars) + 3

    def encode(self, text: str) -> list[int]:
        try:
            return [self._ids[c] for c in text]
        except KeyError as e:
            raise ValueError(f"character {e.args[0]!r} is not in the tokenizer's alphabet {CHARS!r}") from None

    def decode(self, ids) -> str:
        """Text of the ids up to the first eos; pad and bos are dropped."""
        out = []
        for i in ids:
            i = int(i)
            if i == self.eos_id:
                break
            out.append(self._chars.get(i, ""))
        return "".join(out)


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` (fast tokenizer) read with the ``tokenizers`` library."""

    def __init__(self, path: str, *, bos: str | None = None, eos: str | None = None, pad: str | None = None):
        from tokenizers import Tokenizer as _Tok

        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.exists(file):
            raise FileNotFoundError(f"no tokenizer.json at {path!r}: give task.tokenizer_path a local tokenizer.json "
                                    "or the folder holding it")
        self._tok = _Tok.from_file(file)
        self.vocab_size = self._tok.get_vocab_size()
        self.eos_id = self._special(eos, ("<|endoftext|>", "<|eot_id|>", "</s>", "<eos>"))
        self.bos_id = self._special(bos, ("<|begin_of_text|>", "<s>", "<bos>"), default=self.eos_id)
        self.pad_id = self._special(pad, ("<|finetune_right_pad_id|>", "<pad>", "<|endoftext|>"), default=self.eos_id)

    def _special(self, name, candidates, default=None) -> int:
        for token in ([name] if name else []) + list(candidates):
            i = self._tok.token_to_id(token)
            if i is not None:
                return i
        if default is None:
            raise ValueError(f"tokenizer has none of the special tokens {candidates}; name one explicitly")
        return default

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        ids = [int(i) for i in ids]
        if self.eos_id in ids:
            ids = ids[: ids.index(self.eos_id)]
        return self._tok.decode(ids)
