"""Chat templates rendered exactly as Hugging Face transformers renders them (``apply_chat_template``).

A checkpoint's chat template is a Jinja program; the prompt a chat model was trained on is whatever
transformers renders from it, so this module reproduces that environment: a sandboxed, immutable Jinja
environment with ``trim_blocks``/``lstrip_blocks`` and loop controls, transformers' ``tojson`` filter (no HTML
escaping; ``indent``/``ensure_ascii``/``separators``/``sort_keys`` passed to :func:`json.dumps`), the
``raise_exception`` and ``strftime_now`` globals, and the same variables: ``messages``,
``add_generation_prompt``, the tokenizer's named special tokens (``bos_token``, ``eos_token``, ...),
``tools``/``documents`` as ``None`` and any extra keyword (e.g. Qwen3's ``enable_thinking``).

Templates come from checkpoint folders, so they are untrusted code: the sandbox refuses attribute access to
Python internals, and ``namespace`` refuses underscore-prefixed names, as in transformers.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from nereus_jax.rl.errors import TokenizerError

# Names a message's reasoning goes by; templates read the first (transformers fills it from the others).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _one_line(text) -> str:
    return " ".join(str(text).split())


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    """transformers' filter: plain :func:`json.dumps` (Jinja's own escapes HTML characters)."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _DictFactory:
    """The template's ``dict``: builds plain dicts, exposes no type to reach through."""

    def __call__(self, *args, **kwargs) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """Jinja's ``namespace`` that refuses underscore-prefixed attribute names."""

    def __init__(*args, **kwargs):  # Jinja's signature trick, so that namespace(self=...) works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template may not set the namespace attribute {name!r}")


@lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_DictFactory(),
                       namespace=_Namespace)
    return env


@lru_cache(maxsize=32)
def _compile(source: str) -> jinja2.Template:
    return _environment().from_string(source)


def compile_template(source: str, origin: str) -> jinja2.Template:
    """The compiled template, or a TokenizerError naming ``origin`` (the file it came from)."""
    try:
        return _compile(source)
    except jinja2.TemplateSyntaxError as e:
        raise TokenizerError(f"the chat template in {origin} does not compile (line {e.lineno}: "
                             f"{_one_line(e.message)}); fix the template, or remove it to tokenize prompts as "
                             "plain text") from None


def _normalise(messages: Sequence[Mapping[str, Any]]) -> list[dict]:
    """transformers' preparation: fresh dicts without None values; reasoning copied under its standard name."""
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if v is not None}
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def render_chat(source: str, messages: Sequence[Mapping[str, Any]], *, origin: str,
                special_tokens: Mapping[str, str], add_generation_prompt: bool = True, **kwargs: Any) -> str:
    """The text ``apply_chat_template(messages, tokenize=False, add_generation_prompt=...)`` renders.

    ``special_tokens`` are the tokenizer's named special tokens (``bos_token``: "<s>", ...); ``kwargs`` are
    extra template variables (``tools``: function schemas, ``documents``, ``enable_thinking``, ...) and win over
    them, as in transformers. A failing render (the template's own
    ``raise_exception``, or an operation its messages don't support) is a TokenizerError naming ``origin``.
    """
    template = compile_template(source, origin)
    variables = {**special_tokens, "tools": None, "documents": None, **kwargs, "messages": _normalise(messages),
                 "add_generation_prompt": add_generation_prompt}
    try:
        return template.render(variables)
    except (jinja2.TemplateError, TypeError) as e:
        raise TokenizerError(f"the chat template in {origin} failed to render these messages: {_one_line(e)}; "
                             "check the prompt's roles and order against the template") from None
