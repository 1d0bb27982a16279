"""Parsing of config values and tables: link rates, durations, and dataclasses built from TOML mappings.

Every loader names the offending key and what it accepts; nothing here touches the network.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

T = TypeVar("T")


# a number, a decimal prefix, then a unit: bits ("bit", "b" + per second) or bytes ("B"/"byte" + per second)
_RATE = re.compile(
    r"(?P<num>\d+(?:\.\d*)?(?:[eE][+-]?\d+)?|\.\d+)(?P<prefix>[kKmMgGtT]?)"
    r"(?:(?P<bit>bit(?:/s|ps)?)|(?P<b>b(?:/s|ps))|(?P<byte>(?:B|byte)(?:/s|ps)))"
)
_PREFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def parse_rate(text: str | float | int) -> float:
    """Parse a link rate into bytes/s: a number of bits/s, or text such as ``"100mbit"``, ``"1gbit"``,
    ``"100 Mbit/s"``, ``"20Mbps"`` (bits) or ``"2.5MB/s"``, ``"2.5MBps"`` (bytes; capital B).

    The case of ``b`` decides bits or bytes, as in networking usage (tc's ``mbps`` for megabytes is not
    followed: ``20mbps`` is 20 Mbit/s). Prefixes are decimal (k = 1000).
    """
    if isinstance(text, int | float):
        if text <= 0:
            raise ValueError(f"rate must be > 0 bits/s, got {text}")
        return float(text) / 8.0
    m = _RATE.fullmatch(text.strip().replace(" ", ""))
    if m is not None:
        value = float(m["num"]) * _PREFIX[m["prefix"].lower()]
        if 0 < value < float("inf"):
            return value if m["byte"] else value / 8.0
    raise ValueError(
        f"cannot parse link rate {text!r}: use e.g. '20mbit', '1gbit', '100 Mbit/s' (bits) or '2.5MB/s' (bytes)"
    )


def parse_duration(text: str | float | int) -> float:
    """Parse ``"80ms"``, ``"1.5s"``, ``"200us"`` or a number of seconds."""
    if isinstance(text, int | float):
        if text < 0:
            raise ValueError(f"duration must be >= 0, got {text}")
        return float(text)
    s = text.strip().lower()
    for unit, mult in (("ms", 1e-3), ("us", 1e-6), ("s", 1.0)):
        if s.endswith(unit):
            try:
                value = float(s[: -len(unit)]) * mult
            except ValueError:
                break
            if value < 0:
                break
            return value
    raise ValueError(f"cannot parse duration {text!r}: use e.g. '80ms', '1.5s'")


def _build(cls: type[T], data: Any, where: str) -> T:
    """Build a dataclass from a mapping, refusing unknown keys and wrong types with the key's name."""
    prefix = f"{where}." if where else ""
    if isinstance(data, cls):
        return data
    if not isinstance(data, Mapping):
        raise ValueError(f"{where or 'config'} must be a table, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(f"unknown key {prefix}{unknown[0]}; allowed keys: {', '.join(sorted(fields))}")
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        kwargs[key] = _coerce(value, hints[key], prefix + key)
    try:
        return cls(**kwargs)
    except TypeError as exc:  # missing required keys
        raise ValueError(f"{where or 'config'}: {exc}") from None


def _coerce(value: Any, hint: Any, key: str) -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ValueError as exc:
                errors.append(str(exc))
        raise ValueError(errors[0] if errors else f"{key}: bad value {value!r}")
    if hint is float and key.endswith("rate_limit") and isinstance(value, str):
        return parse_rate(value)
    if hint is float and key.endswith("_s") and isinstance(value, str):
        return parse_duration(value)
    if hint is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{key} must be true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{key} must be an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{key} must be a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ValueError(f"{key} must be a string, got {value!r}")
        return value
    if hint is bytes:
        if not isinstance(value, bytes):
            raise ValueError(f"{key} must be bytes (hex string in TOML), got {value!r}")
        return value
    return value
