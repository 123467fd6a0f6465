"""Validated YAML configuration: read a file safely and build typed dataclasses from it.

Every mistake a user can make in a configuration file becomes one :class:`ConfigError` whose message names
the file or the dotted key path (``coordinator.rounds``, ``agents[2].id``) and says what is expected.
Beyond plain ``yaml.safe_load``, duplicate keys in one mapping are refused (YAML would silently keep the last)
and a float field also takes a numeric string such as ``1e-3`` (PyYAML reads that as a string).
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar, Union

import yaml

__all__ = ["ConfigError", "from_mapping", "load_yaml", "to_mapping"]

T = TypeVar("T")

_NUMBER = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?")


class ConfigError(ValueError):
    """A configuration file or value is invalid; the message says where and what is expected."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key repeated within one mapping."""

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        if isinstance(node, yaml.MappingNode):
            seen: set[Any] = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    duplicate = key in seen
                except TypeError:
                    continue  # unhashable key: the base constructor reports it
                if duplicate:
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping", node.start_mark,
                        f"found duplicate key {key!r}", key_node.start_mark,
                    )
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _UniqueKeyLoader.construct_yaml_map
)


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML configuration file whose top level is a mapping (an empty file reads as ``{}``).

    Raises
    ------
    ConfigError
        When the file is missing or unreadable, has a YAML syntax error (the line is named), repeats a key,
        or its top level is not a mapping.
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"Configuration file {str(p)!r} does not exist; check the path.") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(
            f"Configuration file {str(p)!r} could not be read ({exc}); check the path."
        ) from exc
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        problem = getattr(exc, "problem", None) or str(exc)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ConfigError(f"Configuration file {str(p)!r} is not valid YAML{at}: {problem}; fix it.") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"Configuration file {str(p)!r} must hold a mapping of keys to values at the top level, "
            f"not {_kind(data)}."
        )
    return data


# ----------------------------------------------------------------------------------------------------------
# from_mapping


def _kind(value: object) -> str:
    return {
        dict: "a mapping", list: "a list", str: "a string", bool: "a boolean", int: "an integer",
        float: "a number", type(None): "null",
    }.get(type(value), f"a {type(value).__name__}")


def _got(value: object) -> str:
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"got {text} ({type(value).__name__})"


def _label(path: str) -> str:
    return f"{path!r}" if path else "the configuration"


def _expected(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if tp is Any or tp is object:
        return "any value"
    if tp is bool:
        return "a boolean (true or false)"
    if tp is int:
        return "an integer"
    if tp is float:
        return "a number"
    if tp is str:
        return "a string"
    if tp is Path:
        return "a path string"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_expected(a) for a in typing.get_args(tp))
    if origin is list or tp is list:
        return "a list"
    if origin is tuple or tp is tuple:
        return "a list"
    if origin is dict or tp is dict:
        return "a mapping"
    return getattr(tp, "__name__", str(tp))


def _wrong(path: str, tp: Any, value: object) -> ConfigError:
    return ConfigError(f"{_label(path)} must be {_expected(tp)}, {_got(value)}.")


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _convert(tp: Any, value: object, path: str) -> Any:
    """Check ``value`` against the type ``tp`` and convert it; ``path`` names it in errors."""
    if tp is Any or tp is object:
        return value
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return from_mapping(tp, value, path)
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:
            if value is None:
                raise _wrong(path, tp, value)
            return _convert(options[0], value, path)
        for option in options:
            try:
                return _convert(option, value, path)
            except ConfigError:
                continue
        raise _wrong(path, tp, value)
    if origin is Literal:
        for allowed in args:
            if type(allowed) is type(value) and allowed == value:
                return allowed
        raise ConfigError(
            f"{_label(path)} must be one of {', '.join(repr(a) for a in args)}, {_got(value)}."
        )
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _wrong(path, tp, value)
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _wrong(path, tp, value)
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str) and _NUMBER.fullmatch(value.strip()):
            return float(value)
        raise _wrong(path, tp, value)
    if tp is str:
        if isinstance(value, str):
            return value
        raise _wrong(path, tp, value)
    if tp is Path:
        if isinstance(value, str) and value:
            return Path(value).expanduser()
        raise _wrong(path, tp, value)
    if tp is list or origin is list:
        if not isinstance(value, list):
            raise _wrong(path, tp, value)
        item = args[0] if args else Any
        return [_convert(item, v, f"{path}[{i}]") for i, v in enumerate(value)]
    if tp is tuple or origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise _wrong(path, tp, value)
        if not args or (len(args) == 2 and args[1] is Ellipsis):
            item = args[0] if args else Any
            return tuple(_convert(item, v, f"{path}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise ConfigError(f"{_label(path)} must be a list of exactly {len(args)} items, {_got(value)}.")
        return tuple(_convert(a, v, f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, value, strict=True)))
    if tp is dict or origin is dict:
        if not isinstance(value, Mapping):
            raise _wrong(path, tp, value)
        key_tp, val_tp = args if args else (Any, Any)
        out: dict[Any, Any] = {}
        for k, v in value.items():
            if key_tp is str and not isinstance(k, str):
                raise ConfigError(f"{_label(path)} has key {k!r} ({type(k).__name__}); keys must be strings.")
            key = _convert(key_tp, k, path) if key_tp is not str else k
            out[key] = _convert(val_tp, v, _join(path, str(k)))
        return out
    raise TypeError(f"from_mapping does not support the field type {tp!r} (at {path or 'top level'}).")


def from_mapping(cls: type[T], data: object, where: str = "") -> T:
    """Build the dataclass ``cls`` from a mapping, checking every value against the field's type.

    Works recursively for nested dataclasses and with ``from __future__ import annotations``. Supported field
    types: ``int`` (not bool), ``float`` (ints accepted), ``str``, ``bool``, ``pathlib.Path``, ``X | None``,
    unions, ``list[X]``, ``tuple[X, ...]`` / ``tuple[X, Y]`` (from a list), ``dict[str, X]``,
    ``Literal[...]``, ``Any`` and dataclasses. Fields with defaults may be left out; ``init=False`` fields are
    not accepted as keys. ``where`` is the dotted path of ``data`` itself, used as the prefix in messages.

    Raises
    ------
    ConfigError
        For an unknown key (the valid keys are listed), a missing required key, a value of the wrong type,
        or a value a ``Literal`` does not allow; the message names the dotted key path.
    TypeError
        When ``cls`` is not a dataclass or a field has an unsupported type (a programming error).
    """
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"from_mapping needs a dataclass type, got {cls!r}.")
    if not isinstance(data, Mapping):
        raise ConfigError(f"{_label(where)} must be a mapping of keys to values, {_got(data)}.")
    try:
        hints = typing.get_type_hints(cls)
    except NameError as exc:
        raise TypeError(f"Cannot resolve the field types of {cls.__name__}: {exc}.") from exc
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for key in data:
        if not isinstance(key, str):
            raise ConfigError(
                f"{_label(where)} has key {key!r} ({type(key).__name__}); keys must be strings."
            )
        if key not in fields:
            close = difflib.get_close_matches(key, list(fields), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            valid = ", ".join(sorted(fields)) or "(none)"
            raise ConfigError(f"Unknown key {_join(where, key)!r}{hint}; valid keys are: {valid}.")
    kwargs: dict[str, Any] = {}
    for name, field in fields.items():
        path = _join(where, name)
        if name not in data:
            if field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
                raise ConfigError(f"Missing required key {path!r}; add it to the configuration.")
            continue
        kwargs[name] = _convert(hints[name], data[name], path)
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"{_label(where)} is invalid: {exc}") from exc


# ----------------------------------------------------------------------------------------------------------
# to_mapping


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, Path):
        return str(value)
    return value


def to_mapping(obj: Any) -> dict[str, Any]:
    """Turn a dataclass instance back into plain dicts, lists and scalars (tuples become lists).

    The result can be dumped with ``yaml.safe_dump`` and read back with :func:`from_mapping`.
    """
    if not (dataclasses.is_dataclass(obj) and not isinstance(obj, type)):
        raise TypeError(f"to_mapping needs a dataclass instance, got {type(obj).__name__}.")
    result: dict[str, Any] = _plain(obj)
    return result
