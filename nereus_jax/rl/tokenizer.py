"""Tokenizers for the job: a small character tokenizer for the built-in tasks, and a local Hugging Face
checkpoint's tokenizer (``tokenizer.json`` through the ``tokenizers`` library) with its special tokens and chat
template resolved the way transformers resolves them, so prompts are the token ids the model was trained on.

``encode_prompt`` is how the job turns a prompt (a string, or chat messages ``{"role", "content"}``) into ids:
rendered with the checkpoint's chat template when it has one (:mod:`nereus_jax.rl.chat`), otherwise tokenized
as ``tokenizer(text)`` would, with the post-processor's special tokens (e.g. Llama's bos).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from nereus_jax.rl.errors import TokenizerError

CHARS = "0123456789+-*/=()<>[],.:;?! abcdefghijklmnopqrstuvwxyz"

# The named special tokens transformers knows and hands to a chat template.
SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")

Message = Mapping[str, Any]
Prompt = str | Sequence[Message]


class Tokenizer(Protocol):
    pad_id: int
    bos_id: int | None
    eos_id: int
    eos_ids: tuple[int, ...]
    vocab_size: int
    chat_template: str | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids) -> str: ...

    def encode_prompt(self, prompt: Prompt, *, system_prompt: str | None = None, chat: bool | None = None,
                      **template_kwargs: Any) -> list[int]: ...


def _no_template(who: str) -> TokenizerError:
    return TokenizerError(f"{who} has no chat template, so prompts cannot be rendered as chat (chat messages, or "
                          "task.chat_template=true): use a checkpoint whose tokenizer_config.json or "
                          "chat_template.jinja has one (model.hf_path / task.tokenizer_path), or give prompts as "
                          "plain strings")


class CharTokenizer:
    """One token per character of :data:`CHARS`; 0 = pad, 1 = bos, 2 = eos. Unknown characters are an error."""

    pad_id, bos_id, eos_id = 0, 1, 2
    eos_ids = (2,)
    chat_template = None

    def __init__(self, chars: str = CHARS):
        self._ids = {c: i + 3 for i, c in enumerate(chars)}
        self._chars = dict(enumerate(chars, start=3))
        self.vocab_size = len(chars) + 3

    def encode(self, text: str) -> list[int]:
        try:
            return [self._ids[c] for c in text]
        except KeyError as e:
            raise TokenizerError(
                f"character {e.args[0]!r} is not in the built-in character tokenizer's alphabet "
                f"{''.join(self._ids)!r}: for other text set task.tokenizer_path (a tokenizer.json) or "
                "model.hf_path (a checkpoint with one)") from None

    def decode(self, ids) -> str:
        """Text of the ids up to the first eos; pad and bos are dropped."""
        out = []
        for i in ids:
            i = int(i)
            if i == self.eos_id:
                break
            out.append(self._chars.get(i, ""))
        return "".join(out)

    def encode_prompt(self, prompt: Prompt, *, system_prompt: str | None = None, chat: bool | None = None,
                      **template_kwargs: Any) -> list[int]:
        """``[bos] + encode(system_prompt + prompt)``: the system prompt is plain text put first (no separator)."""
        if chat or not isinstance(prompt, str):
            raise _no_template("the built-in character tokenizer")
        return [self.bos_id] + self.encode((system_prompt or "") + prompt)


def as_messages(prompt: Prompt, system_prompt: str | None = None) -> list[dict]:
    """Chat messages for a prompt: a string is one user message; ``system_prompt`` becomes a first system message."""
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, Sequence) and prompt:
        messages = [_checked_message(i, m) for i, m in enumerate(prompt)]
    else:
        raise TokenizerError(f"a prompt is a string or a non-empty list of chat messages {{'role', 'content'}}, "
                             f"not {type(prompt).__name__} {str(prompt)[:60]!r}")
    if system_prompt is not None:
        if messages[0]["role"] == "system":
            raise TokenizerError("the prompt already starts with a system message and a system prompt is set too "
                                 "(task.system_prompt): drop one of them")
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def _checked_message(i: int, m: Any) -> dict:
    if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or "content" not in m:
        raise TokenizerError(f"chat message {i} of the prompt is {str(m)[:80]!r}: each message is a mapping with a "
                             "string 'role' (system / user / assistant) and a 'content'")
    return dict(m)


def _read_json(folder: str | None, name: str) -> dict:
    """A config file of the checkpoint folder as a dict ({} when absent)."""
    path = os.path.join(folder, name) if folder else None
    if path is None or not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenizerError(f"{path} is not readable JSON ({e}): restore it from the checkpoint, or delete "
                             "it") from None
    if not isinstance(data, dict):
        raise TokenizerError(f"{path} holds a JSON {type(data).__name__}, not an object: restore it from the "
                             "checkpoint")
    return data


def _token_string(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict ``{"content": ...}``."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _named_tokens(config: Mapping, special_map: Mapping) -> dict[str, str | None]:
    """Named special tokens: tokenizer_config.json's, else special_tokens_map.json's; a key set to null stays None.
    Model-specific ``*_token`` strings of tokenizer_config.json (e.g. ``image_token``) come along, as in
    transformers, since templates may use them. Keys neither file mentions are absent."""
    named = {k: _token_string(v) for k, v in config.items()
             if k.endswith("_token") and k not in SPECIAL_KEYS and _token_string(v) is not None}
    for key in SPECIAL_KEYS:
        if key in config:
            named[key] = _token_string(config[key])
        elif key in special_map:
            named[key] = _token_string(special_map[key])
    return named


def _ids_of(value: Any) -> list[int]:
    """generation_config.json's ``*_token_id``: an int, a list of ints, or absent."""
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _locate(path: str) -> tuple[str, str]:
    """(folder, tokenizer.json file) of a checkpoint folder or of a tokenizer.json path."""
    if os.path.isdir(path):
        file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(file):
            raise TokenizerError(f"no tokenizer.json in {path!r}: give a Hugging Face checkpoint folder that holds "
                                 "tokenizer.json (saved by transformers' save_pretrained), or the tokenizer.json file")
        return path, file
    if not os.path.isfile(path):
        raise TokenizerError(f"{path!r} does not exist: give a local checkpoint folder or its tokenizer.json")
    return os.path.dirname(path) or ".", path


def _load_tokenizer_json(file: str):
    from tokenizers import Tokenizer as _Tok

    try:
        return _Tok.from_file(file)
    except Exception as e:  # the Rust side raises plain Exception for every parse failure
        why = " ".join(str(e).split())[:120]
        raise TokenizerError(f"{file} is not a Hugging Face tokenizer.json ({why}): give the tokenizer.json that "
                             "ships with the checkpoint") from None


class HFTokenizer:
    """A local Hugging Face tokenizer: ``tokenizer.json`` plus the special tokens and chat template of
    ``tokenizer_config.json``, ``special_tokens_map.json``, ``generation_config.json`` and ``chat_template.jinja``.

    ``path`` is a checkpoint folder or a ``tokenizer.json`` (its folder's config files are read too). ``bos``,
    ``eos`` and ``pad`` name tokens that override the checkpoint's. ``eos_ids`` holds every id that ends a
    generation: the tokenizer's eos and generation_config.json's ``eos_token_id`` list (Llama-3 Instruct stops at
    ``<|eot_id|>`` and ``<|end_of_text|>``). ``bos_id`` is None where the checkpoint has no bos (Qwen). ``pad_id``
    falls back to generation_config.json's ``pad_token_id``, then to the eos.
    """

    def __init__(self, path: str, *, bos: str | None = None, eos: str | None = None, pad: str | None = None):
        self.path = path
        self.folder, self.file = _locate(path)
        self._tok = _load_tokenizer_json(self.file)
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values(), default=-1) + 1
        config = _read_json(self.folder, "tokenizer_config.json")
        gen = _read_json(self.folder, "generation_config.json")
        named = _named_tokens(config, _read_json(self.folder, "special_tokens_map.json"))
        overrides = {"bos_token": bos, "eos_token": eos, "pad_token": pad}
        named.update({k: v for k, v in overrides.items() if v is not None})
        self.special_tokens = {k: v for k, v in named.items() if v is not None}
        self._resolve_ids(named, overrides, gen)
        self.chat_template, self.template_origin = self._read_chat_template(config)

    def _where(self, key: str, overrides: Mapping[str, str | None]) -> str:
        if overrides.get(key) is not None:
            return f"the {key.removesuffix('_token')} override"
        return f"{key} in {os.path.join(self.folder, 'tokenizer_config.json')} (or special_tokens_map.json)"

    def _token_id(self, named: Mapping, key: str, overrides: Mapping) -> int | None:
        token = named.get(key)
        if token is None:
            return None
        i = self._tok.token_to_id(token)
        if i is None:
            raise TokenizerError(f"{self._where(key, overrides)} names {token!r}, which {self.file} does not contain: "
                                 "name a token of this tokenizer")
        return i

    def _gen_ids(self, gen: Mapping, key: str) -> list[int]:
        ids = _ids_of(gen.get(key))
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise TokenizerError(f"{key} {bad} in {os.path.join(self.folder, 'generation_config.json')} is outside "
                                 f"the tokenizer's ids 0..{self.vocab_size - 1}: fix it, or delete the key")
        return ids

    def _resolve_ids(self, named: Mapping, overrides: Mapping, gen: Mapping) -> None:
        gen_eos = self._gen_ids(gen, "eos_token_id")
        eos = self._token_id(named, "eos_token", overrides)
        if eos is None and not gen_eos:
            raise TokenizerError(
                f"no end-of-sequence token for {self.path!r}: set eos_token in tokenizer_config.json (or eos_token_id "
                "in generation_config.json) of the checkpoint, or pass the eos override (eos='<token>')")
        self.eos_id = eos if eos is not None else gen_eos[0]
        self.eos_ids = tuple(dict.fromkeys([self.eos_id, *gen_eos]))
        self.bos_id = self._token_id(named, "bos_token", overrides)
        if self.bos_id is None and "bos_token" not in named:
            self.bos_id = next(iter(self._gen_ids(gen, "bos_token_id")), None)
        pad = self._token_id(named, "pad_token", overrides)
        self.pad_id = pad if pad is not None else next(iter(self._gen_ids(gen, "pad_token_id")), self.eos_id)

    def _read_chat_template(self, config: Mapping) -> tuple[str | None, str | None]:
        """The default chat template and the file it came from; chat_template.jinja wins, as in transformers."""
        file = os.path.join(self.folder, "chat_template.jinja")
        if os.path.isfile(file):
            try:
                with open(file, encoding="utf-8") as f:
                    return f.read(), file
            except (OSError, UnicodeDecodeError) as e:
                raise TokenizerError(f"{file} is not readable text ({e}): restore it, or delete it") from None
        origin = os.path.join(self.folder, "tokenizer_config.json")
        value = config.get("chat_template")
        if value is None:
            return None, None
        if isinstance(value, str):
            return value, origin
        named = {}
        if isinstance(value, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
            named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
        if not isinstance(named.get("default"), str):
            raise TokenizerError(f"chat_template in {origin} is neither a template string nor a list of named "
                                 f"templates with a 'default' one (names: {sorted(map(str, named))}): add a "
                                 "'default' entry, or put the template in chat_template.jinja")
        return named["default"], origin

    def encode(self, text: str) -> list[int]:
        """Ids of ``text`` without the post-processor's special tokens (special-token strings still match)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        """Text of the ids up to the first of :attr:`eos_ids`, special tokens skipped."""
        ids = [int(i) for i in ids]
        stops = set(self.eos_ids)
        end = next((k for k, i in enumerate(ids) if i in stops), len(ids))
        return self._tok.decode(ids[:end], skip_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        """The text of one token as the tokenizer's vocabulary spells it (e.g. ``<|im_end|>``)."""
        return self._tok.decode([int(token_id)], skip_special_tokens=False)

    def render(self, messages: Sequence[Message], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """The chat template's text for ``messages``, as transformers' ``apply_chat_template(tokenize=False)``."""
        if self.chat_template is None:
            raise _no_template(f"the tokenizer at {self.path!r}")
        from nereus_jax.rl.chat import render_chat

        return render_chat(self.chat_template, as_messages(messages), origin=self.template_origin,
                           special_tokens=self.special_tokens, add_generation_prompt=add_generation_prompt, **kwargs)

    def encode_prompt(self, prompt: Prompt, *, system_prompt: str | None = None, chat: bool | None = None,
                      **template_kwargs: Any) -> list[int]:
        """A prompt's ids. With the chat template (``chat=None``: whenever there is one) the rendered text is
        tokenized without added special tokens, as ``apply_chat_template(..., tokenize=True)`` does (the template
        writes bos itself); ``template_kwargs`` reach the template (e.g. ``enable_thinking=False``). Without it, a
        string (the system prompt put first as plain text) is tokenized as ``tokenizer(text)``, bos included."""
        use_template = self.chat_template is not None if chat is None else chat
        if use_template:
            text = self.render(as_messages(prompt, system_prompt), add_generation_prompt=True, **template_kwargs)
            return self.encode(text)
        if not isinstance(prompt, str) and self.chat_template is None:
            raise _no_template(f"the tokenizer at {self.path!r}")
        if not isinstance(prompt, str):
            raise TokenizerError("the prompt is a list of chat messages but the chat template is off "
                                 "(task.chat_template=false): give plain-string prompts, or turn the template on")
        return self._tok.encode((system_prompt or "") + prompt, add_special_tokens=True).ids


def load_tokenizer(tokenizer_path: str | None, hf_path: str | None) -> Tokenizer:
    """``task.tokenizer_path`` if set, else the tokenizer of the ``model.hf_path`` checkpoint, else the built-in
    character tokenizer. Errors name the config key that pointed at the files."""
    for key, path in (("task.tokenizer_path", tokenizer_path), ("model.hf_path", hf_path)):
        if path:
            try:
                return HFTokenizer(path)
            except TokenizerError as e:
                raise TokenizerError(f"{key}={path!r}: {e}") from None
    return CharTokenizer()
