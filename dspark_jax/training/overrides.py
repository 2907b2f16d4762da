"""MaxText-style ``key=value`` overrides of the configuration dataclasses (:class:`TrainConfig`
and the configs it nests): ``apply_overrides(cfg, ["drafter.num_layers=2"])``.

A dataclass may name flat aliases of nested keys in a ``KEY_ALIASES`` class attribute
(``{"block_size": "drafter.block_size"}``): ``block_size=4`` then sets ``drafter.block_size``."""

from __future__ import annotations

import dataclasses
import json
import typing
from collections.abc import Mapping, Sequence
from typing import Any

from dspark_jax.config import renamed_key


def _coerce(value: str, typ: Any) -> Any:
    """Parses a command-line string into the annotated field type."""
    origin = typing.get_origin(typ)
    args = typing.get_args(typ)
    if typ is bool:
        low = value.lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"expected a boolean, got {value!r}")
    if typ is int:
        return int(value)
    if typ is float:
        return float(value)
    if typ is str:
        return value
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        if value.lower() in ("none", "null") and type(None) in args:
            return None
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a)
            except (ValueError, TypeError):
                continue
        raise ValueError(f"cannot parse {value!r} as {typ}")
    if origin in (tuple, list, Sequence):
        parsed = json.loads(value) if value.strip().startswith("[") else [v for v in value.split(",") if v.strip()]
        inner = args[0] if args else str
        return tuple(_coerce(str(v), inner) for v in parsed)
    return json.loads(value)


def apply_overrides(cfg: Any, overrides: Sequence[str] | dict[str, Any]) -> Any:
    """Returns a copy of dataclass ``cfg`` with ``key=value`` overrides applied.

    Nested dataclass fields are addressed with dots (``drafter.num_layers=2``), or, in a dict, as
    a nested mapping (``{"drafter": {"num_layers": 2}}``); the dataclass's ``KEY_ALIASES`` map flat
    names onto nested ones. Values given as strings are parsed according to the field's type annotation.

    Raises:
      ValueError: unknown key, malformed ``key=value`` or unparsable value.
    """
    if not isinstance(overrides, dict):
        pairs = {}
        for item in overrides:
            if "=" not in item:
                raise ValueError(f"override {item!r} is not of the form key=value")
            k, v = item.split("=", 1)
            pairs[k.strip()] = v
        overrides = pairs
    for key, value in flatten_keys(overrides).items():
        cfg = _set_path(cfg, key.split("."), value, key)
    return cfg


def flatten_keys(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"drafter": {"block_size": 4}}`` -> ``{"drafter.block_size": 4}`` (other values kept)."""
    out: dict[str, Any] = {}
    for k, v in data.items():
        if isinstance(v, Mapping):
            out.update(flatten_keys(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _set_path(cfg: Any, path: list[str], value: Any, full: str) -> Any:
    hints = typing.get_type_hints(type(cfg))
    fields = {f.name for f in dataclasses.fields(cfg)}
    head = path[0]
    if head not in fields:
        head = renamed_key(head, "config key")
    aliases: dict[str, str] = getattr(type(cfg), "KEY_ALIASES", {})
    if head not in fields and head in aliases:
        return _set_path(cfg, aliases[head].split(".") + path[1:], value, full)
    if head not in fields:
        raise ValueError(f"unknown config key {full!r}; valid keys here: {', '.join(sorted(fields | set(aliases)))}")
    if len(path) == 1 and dataclasses.is_dataclass(getattr(cfg, head)):  # drafter={"block_size": 4}
        parsed = json.loads(value) if isinstance(value, str) else value
        if not isinstance(parsed, Mapping):
            raise ValueError(f"config key {full!r} takes a mapping of its sub-keys, got {value!r}")
        for key, v in flatten_keys(parsed).items():
            cfg = _set_path(cfg, [head, *key.split(".")], v, f"{full}.{key}")
        return cfg
    if len(path) > 1:
        sub = getattr(cfg, head)
        if not dataclasses.is_dataclass(sub):
            raise ValueError(f"config key {full!r}: {head!r} has no sub-keys")
        return dataclasses.replace(cfg, **{head: _set_path(sub, path[1:], value, full)})
    if isinstance(value, str):
        try:
            value = _coerce(value, hints[head])
        except (ValueError, TypeError, json.JSONDecodeError) as e:
            raise ValueError(f"bad value for {full!r}: {e}") from None
    return dataclasses.replace(cfg, **{head: value})
