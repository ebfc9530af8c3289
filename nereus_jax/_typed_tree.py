"""A typed tree of frozen dataclasses read from plain data: the machinery behind nereus_jax.config.

`from_dict(cls, data, prefix)` walks a dataclass's fields by their type hints (int, float, str, bool,
Optional/union, Literal, tuple[X, ...], list, dict[str, X], nested dataclasses), converts and checks every
value, and raises `ConfigError` naming the full dotted key. `parse_yaml` reads YAML with `1e-5` as a float.
"""

import dataclasses
import difflib
import re
import types
import typing
from collections.abc import Mapping, Sequence
from functools import cache
from typing import Any, Literal

import yaml


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the dotted key and what to change."""


def require(ok: bool, message: str) -> None:
    """Raises ConfigError(message) unless ok."""
    if not ok:
        raise ConfigError(message)


def unknown_name_error(what: str, key: str, name: str, valid: Sequence[str], parent: str) -> ConfigError:
    close = difflib.get_close_matches(name, valid, n=1)
    hint = f" — did you mean '{join(parent, close[0])}'?" if close else ""
    where = f"in '{parent}'" if parent else "at the top level"
    return ConfigError(f"unknown {what} '{key}'{hint} (valid {what}s {where}: {', '.join(valid)})")


@cache
def field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def show(value: Any) -> str:
    if value is None:
        return "null"
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


def from_dict(cls: type, data: Any, prefix: str) -> Any:
    """Build dataclass `cls` from a mapping, converting and checking every field; keys named from `prefix`."""
    if not isinstance(data, Mapping):
        where = prefix or "config"
        raise ConfigError(f"{where}: expected a mapping of {cls.__name__} keys, got {show(data)}")
    types_ = field_types(cls)
    kwargs = {}
    for name, value in data.items():
        key = join(prefix, str(name))
        if name not in types_:
            raise unknown_name_error("key", key, str(name), list(types_), prefix)
        kwargs[name] = _convert(types_[name], value, key)
    _check_required(cls, kwargs, prefix)
    return cls(**kwargs)


def _check_required(cls: type, kwargs: Mapping[str, Any], prefix: str) -> None:
    for f in dataclasses.fields(cls):
        missing = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        require(not missing or f.name in kwargs, f"{join(prefix, f.name)} is required")


def _convert(tp: Any, value: Any, key: str) -> Any:
    """Check `value` against type hint `tp`; convert it (list -> tuple, int -> float, dict -> dataclass)."""
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, key)
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return _convert_union(tp, value, key)
    if origin is Literal:
        return _convert_literal(tp, value, key)
    if origin in (tuple, list):
        return _convert_sequence(tp, value, key)
    if origin is dict:
        return _convert_mapping(tp, value, key)
    return _convert_scalar(tp, value, key)


def _convert_union(tp: Any, value: Any, key: str) -> Any:
    options = [a for a in typing.get_args(tp) if a is not type(None)]
    if value is None and len(options) < len(typing.get_args(tp)):
        return None
    errors = []
    for option in options:
        try:
            return _convert(option, value, key)
        except ConfigError as error:
            errors.append(error)
    if len(options) == 1:
        raise errors[0]
    raise ConfigError(f"{key}: expected {type_name(tp)}, got {show(value)}")


def _convert_literal(tp: Any, value: Any, key: str) -> Any:
    allowed = typing.get_args(tp)
    if any(value == a and type(value) is type(a) for a in allowed):
        return value
    raise ConfigError(f"{key}: expected one of {', '.join(map(repr, allowed))}, got {show(value)}")


def _convert_sequence(tp: Any, value: Any, key: str) -> Any:
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{key}: expected a list, got {show(value)}")
    args = typing.get_args(tp)
    assert typing.get_origin(tp) is list or args[1:] == (Ellipsis,), f"{key}: use tuple[X, ...], not {tp}"
    items = [_convert(args[0], item, f"{key}[{i}]") for i, item in enumerate(value)]
    return tuple(items) if typing.get_origin(tp) is tuple else items


def _convert_mapping(tp: Any, value: Any, key: str) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{key}: expected a mapping, got {show(value)}")
    value_tp = typing.get_args(tp)[1]
    for name in value:
        require(isinstance(name, str), f"{key}: keys must be strings, got {show(name)}")
    return {name: _convert(value_tp, item, f"{key}.{name}") for name, item in value.items()}


_ACCEPTED = {bool: (bool,), int: (int,), float: (int, float), str: (str,)}


def _convert_scalar(tp: Any, value: Any, key: str) -> Any:
    assert tp in _ACCEPTED, f"{key}: the loader does not handle type {tp!r}"
    if not isinstance(value, _ACCEPTED[tp]) or (isinstance(value, bool) and tp is not bool):
        raise ConfigError(f"{key}: expected {tp.__name__}, got {show(value)}")
    return float(value) if tp is float else value


def type_name(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return " | ".join("None" if a is type(None) else type_name(a) for a in args)
    if origin is Literal:
        return "{" + ", ".join(map(str, args)) + "}"
    if origin in (tuple, list):
        return f"list[{type_name(args[0])}]"
    if origin is dict:
        return f"dict[{type_name(args[0])}, {type_name(args[1])}]"
    return tp.__name__


def to_plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (tuple, list)):
        return [to_plain(item) for item in obj]
    if isinstance(obj, Mapping):
        return {name: to_plain(item) for name, item in obj.items()}
    return obj


class _YamlLoader(yaml.SafeLoader):
    """SafeLoader that also reads `1e-5` as a float (YAML 1.1 wants `1.0e-5`; everyone writes `1e-5`)."""


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def parse_yaml(text: str) -> Any:
    loader = _YamlLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()
