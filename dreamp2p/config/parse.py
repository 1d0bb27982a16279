"""Parsing of config values and tables: link rates, durations, and dataclasses built from TOML mappings.

Every loader names the offending key and what it accepts; nothing here touches the network.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from collections.abc import Iterable, Mapping
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


_DURATION = re.compile(r"(?P<num>\d+(?:\.\d*)?(?:[eE][+-]?\d+)?|\.\d+)(?P<unit>us|µs|ms|s|m|min|h)")
_SECONDS = {"us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}


def parse_duration(text: str | float | int) -> float:
    """Parse a duration into seconds: ``"200us"``, ``"80ms"``, ``"1.5s"``, ``"5m"`` (minutes), ``"1h"``, or a
    number of seconds. ``m`` is minutes and ``ms`` milliseconds, as in tc and Go."""
    if isinstance(text, int | float):
        if text < 0:
            raise ValueError(f"duration must be >= 0, got {text}")
        return float(text)
    m = _DURATION.fullmatch(text.strip().lower().replace(" ", ""))
    if m is not None:
        value = float(m["num"]) * _SECONDS[m["unit"]]
        if value < float("inf"):
            return value
    raise ValueError(f"cannot parse duration {text!r}: use e.g. '80ms', '1.5s', '5m', '1h'")


def did_you_mean(key: str, allowed: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the allowed name closest to a misspelt ``key``, or ``""`` when none is close."""
    close = difflib.get_close_matches(key, list(allowed), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def one_of_message(key: str, value: Any, allowed: Iterable[str]) -> str:
    """The message for an enumerated setting given a value it does not take: the full key (``sync.strategy``),
    every value it takes, the value given and the closest allowed one."""
    names = list(allowed)
    hint = did_you_mean(value, names) if isinstance(value, str) else ""
    return f"{key} must be one of {', '.join(names)}; got {value!r}{hint}"


def unknown_key_message(key: str, where: str, allowed: Iterable[str]) -> str:
    """The message for a key no table of that name has: the key, a close allowed name, every allowed name."""
    names = sorted(allowed)
    return f"unknown key {where}{key}{did_you_mean(key, names)}; allowed keys: {', '.join(names)}"


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
        raise ValueError(unknown_key_message(unknown[0], prefix, fields))
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
    if hint is float and isinstance(value, str) and (key.endswith("rate_limit") or key.endswith("_s")):
        try:
            return parse_rate(value) if key.endswith("rate_limit") else parse_duration(value)
        except ValueError as exc:
            raise ValueError(f"{key}: {exc}") from None
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
