"""argparse value types of the `dreamp2p` subcommands (each turns one flag's text into a checked value) and
the one check across flags that `plan` and `bench` share (`check_delay`)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from dreamp2p.config.parse import parse_duration, parse_rate


def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an integer >= ``low``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    return parse


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0 (``7e9`` is fine)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def step_times(text: str) -> tuple[float, ...]:
    """An argparse type: one number > 0, or several comma-separated (one per region: ``0.3,0.6``)."""
    return tuple(positive_float(part.strip()) for part in text.split(","))


def nonneg_float(text: str) -> float:
    """An argparse type: a finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def open_fraction(text: str) -> float:
    """An argparse type: a compute utilization strictly between 0 and 1 (1.0 would need infinite bandwidth)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0.0 < value < 1.0:  # also refuses NaN
        raise argparse.ArgumentTypeError(f"must be a compute utilization in (0, 1), e.g. 0.95, got {text}")
    return value


def address_with_port(text: str) -> str:
    """An argparse type: a gRPC address that names its port (``HOST:PORT``, ``[V6]:PORT``, ``unix:PATH``).

    gRPC would dial a bare host on port 443, which is never a dreamp2p peer: refuse it instead.
    """
    addr = text.strip()
    if addr.startswith(("unix:", "unix-abstract:")):
        return addr
    rest = addr
    for scheme in ("ipv4:", "ipv6:", "dns:"):
        if rest.startswith(scheme):
            rest = rest[len(scheme) :]
            if rest.startswith("//"):  # dns://authority/host:port
                rest = rest[2:].partition("/")[2]
            break
    if rest.startswith("["):
        host, _, port = rest[1:].partition("]")
        if not port.startswith(":"):
            raise argparse.ArgumentTypeError(f"address {text!r} has no port; use [IPV6]:PORT")
        port = port[1:]
    elif rest.count(":") == 1:
        host, _, port = rest.partition(":")
    elif ":" in rest:
        raise argparse.ArgumentTypeError(f"address {text!r}: put an IPv6 address in brackets, [IPV6]:PORT")
    else:
        raise argparse.ArgumentTypeError(f"address {text!r} has no port; use HOST:PORT")
    if not host:
        raise argparse.ArgumentTypeError(f"address {text!r} has no host; use HOST:PORT")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"address {text!r}: port must be a number in 1..65535, got {port!r}")
    return addr


def link_rate(text: str) -> str:
    """An argparse type: a link rate as `dreamp2p.config.parse_rate` reads it (``20mbit``, ``20Mbit/s``,
    ``2.5MB/s``, ``1gbit``); the text is kept as given, for the command to parse and to print."""
    try:
        parse_rate(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def duration(text: str) -> str:
    """An argparse type: a duration as `dreamp2p.config.parse_duration` reads it (``80ms``, ``30s``, ``5m``,
    ``1h``); the text is kept as given."""
    try:
        parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def check_delay(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """DreamDDP's landing delay d must stay below the period H (a layer lands before it is launched again)."""
    if args.max_delay is not None and args.max_delay >= args.period:
        parser.error(
            f"--max-delay ({args.max_delay}) must be less than --period ({args.period}): a layer's sync has to land "
            "before the same layer is launched again one period later"
        )
