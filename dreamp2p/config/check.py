"""`dreamp2p config check FILE`: every error of a node daemon's file at once, not only the first.

The loaders (:meth:`DaemonConfig.from_dict` and the tables' ``__post_init__``) stop at the first error, which
suits a daemon starting up but makes an operator fix a file one error per run. Here each table is checked on
its own: unknown keys (with the closest allowed name), values of the wrong type, then the table's own checks
run again and again, each time without the keys the last error named, so every independent error is found.
What is reported is always the loaders' own message (one that opens with a bare key of ``[node]`` gets its
table in front: ``node.codec``). The certificate, key and CA files of ``[node.tls]`` are read too
(`dreamp2p.config.certs`: dates, key against certificate, certificate against CA), as a starting node reads
them. A file found clean is finally loaded whole by :meth:`DaemonConfig.from_dict`, so ``config check``
never passes a file that ``dreamp2p node`` would refuse.
"""

from __future__ import annotations

import dataclasses
import os
import re
import tomllib
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dreamp2p.config.certs import tls_file_problems
from dreamp2p.config.daemon import (
    DAEMON_KEYS,
    CheckpointConfig,
    DaemonConfig,
    MetricsConfig,
    check_top_level,
    unknown_top_level_message,
)
from dreamp2p.config.parse import _coerce, unknown_key_message
from dreamp2p.config.peer import PeerConfig, PeerInfo, TLSConfig, TransportConfig
from dreamp2p.config.sync import REMOVED_KEYS, SyncConfig
from dreamp2p.config.task import TaskConfig
from dreamp2p.config.train import TrainConfig, train_errors

# keys of [node] that the loader turns into something else before building PeerConfig
_NODE_EXTRA = ("token_env",)


def check_file(path: str | Path) -> list[str]:
    """Every error found in a node daemon's TOML file (empty when ``dreamp2p node`` would accept it)."""
    p = Path(path)
    try:
        with open(p, "rb") as fh:
            data = tomllib.load(fh)
    except OSError as exc:
        return [f"cannot read {p}: {exc.strerror or exc}"]
    except tomllib.TOMLDecodeError as exc:
        return [f"not valid TOML: {exc}"]
    errors = check_daemon_config(data)
    if not errors:
        try:
            DaemonConfig.from_dict(data, base=p.parent)
        except ValueError as exc:  # a check the walk above does not know: still reported
            errors.append(str(exc))
    return errors


def check_daemon_config(data: Mapping[str, Any]) -> list[str]:
    """Every error of a daemon file's parsed TOML, in file order of the tables."""
    errors = [unknown_top_level_message(key) for key in data if key not in DAEMON_KEYS]
    if "node" not in data:
        errors.append("missing [node] table (node_id, listen, ring, ...)")
    else:
        errors += node_errors(data["node"])
    sync = data.get("sync", {})
    if isinstance(sync, Mapping):
        errors += [f"sync.{key} is no longer a setting: {why}" for key, why in REMOVED_KEYS.items() if key in sync]
        sync = {k: v for k, v in sync.items() if k not in REMOVED_KEYS}
    tables: tuple[tuple[str, type[Any]], ...] = (
        ("sync", SyncConfig),
        ("task", TaskConfig),
        ("train", TrainConfig),
        ("checkpoint", CheckpointConfig),
        ("metrics", MetricsConfig),
    )
    clean: dict[str, Any] = {}
    for name, cls in tables:
        found = table_errors(cls, sync if name == "sync" else data.get(name, {}), name)
        errors += found
        if not found:
            clean[name] = _build_quietly(cls, sync if name == "sync" else data.get(name, {}))
    for key in ("device", "threads", "stop_grace_s"):
        if key in data:
            try:
                check_top_level(key, data[key])
            except ValueError as exc:
                errors.append(str(exc))
    return errors + _across_tables(clean, data.get("device", "auto"))


def _across_tables(clean: Mapping[str, Any], device: Any) -> list[str]:
    """The checks that read two tables (``[train]`` against ``[task]`` and ``device``), once both are clean."""
    if "train" not in clean or "task" not in clean:
        return []
    return train_errors(clean["train"], clean["task"].lr, clean["task"].steps, device)


def node_errors(node: Any) -> list[str]:
    """Errors of the ``[node]`` table and its sub-tables (transport, tls, ring)."""
    if not isinstance(node, Mapping):
        return [f"node must be a table, got {type(node).__name__}"]
    data = dict(node)
    errors: list[str] = []
    if "token_env" in data:
        env = data.pop("token_env")
        if not isinstance(env, str) or env not in os.environ:
            errors.append(f"node.token_env names environment variable {env!r}, which is not set")
        else:
            data["token"] = os.environ[env]
    built: dict[str, Any] = {}
    for key, cls in (("transport", TransportConfig), ("tls", TLSConfig)):
        if key in data:
            sub = table_errors(cls, data[key], f"node.{key}")
            errors += sub
            if not sub:
                built[key] = _build_quietly(cls, data[key])
    if "tls" in built:
        errors += tls_file_problems(built["tls"], "node.tls")
    if "ring" in data:
        ring = data["ring"]
        if not isinstance(ring, list):
            errors.append("node.ring must be a list of {node_id = ..., address = ...} tables")
        else:
            sub = [e for i, r in enumerate(ring) for e in table_errors(PeerInfo, r, f"node.ring[{i}]")]
            errors += sub
            if not sub:
                built["ring"] = tuple(PeerInfo(**r) for r in ring)
    if isinstance(data.get("manifest_hash"), str):
        try:
            data["manifest_hash"] = bytes.fromhex(data["manifest_hash"])
        except ValueError:
            errors.append("node.manifest_hash must be a hex string")
            del data["manifest_hash"]
    flat = {k: v for k, v in data.items() if k not in ("transport", "tls", "ring")}
    return errors + table_errors(PeerConfig, flat, "node", extra=_NODE_EXTRA, prebuilt=built)


def table_errors(
    cls: type[Any],
    data: Any,
    where: str,
    *,
    extra: tuple[str, ...] = (),
    prebuilt: Mapping[str, Any] | None = None,
) -> list[str]:
    """Every error of one table built into the dataclass ``cls``; ``prebuilt`` fields are taken as they are."""
    if not isinstance(data, Mapping):
        return [f"{where} must be a table, got {type(data).__name__}"]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    errors: list[str] = []
    good: dict[str, Any] = dict(prebuilt or {})
    for key, value in data.items():
        if key in extra:
            continue
        if key not in fields:
            errors.append(unknown_key_message(key, f"{where}.", fields))
            continue
        try:
            good[key] = _coerce(value, hints[key], f"{where}.{key}")
        except ValueError as exc:
            errors.append(str(exc))
    bad = {key for key in data if key in fields and key not in good}
    required = [n for n, f in fields.items() if _required(f) and n not in data]
    if required:
        return [*errors, f"{where}: missing key{'s' if len(required) > 1 else ''} {', '.join(required)}"]
    if any(_required(fields[key]) for key in bad):
        return errors  # a required key with a bad value: the table's own checks cannot run without it
    return errors + _post_init_errors(cls, good, set(fields), where)


def _post_init_errors(cls: type[Any], good: dict[str, Any], names: set[str], where: str = "") -> list[str]:
    """Build ``cls`` again and again, each time without the fields the last error named, collecting the errors.

    An error that names a field already taken out may come from the default put in its place, so it is not
    reported (the error that took that field out was). An error that opens with a bare field name (a type
    also built outside a daemon's file, as ``PeerConfig`` is) gets its table in front: ``node.codec ...``.
    """
    errors: list[str] = []
    dropped: set[str] = set()
    kwargs = dict(good)
    for _ in range(len(names) + 1):
        try:
            cls(**kwargs)
            break
        except (ValueError, TypeError) as exc:
            message = str(exc)
            named = {n for n in names if re.search(rf"(?<!\w){re.escape(n)}(?!\w)", message)}
            if not named & dropped:
                errors.append(_qualified(message, where, names))
            removable = {n for n in named & set(kwargs) if not _is_required(cls, n)}
            if not removable:
                break  # nothing left to take out: no further error can be told apart
            dropped |= removable
            for n in removable:
                del kwargs[n]
    return errors


def _qualified(message: str, where: str, names: set[str]) -> str:
    """``message`` with ``where.`` before the field name it opens with, if it opens with one."""
    first = re.match(r"\w+", message)
    return f"{where}.{message}" if where and first is not None and first.group() in names else message


def _required(f: dataclasses.Field[Any]) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def _is_required(cls: type[Any], name: str) -> bool:
    return any(f.name == name and _required(f) for f in dataclasses.fields(cls))


def _build_quietly(cls: type[Any], data: Mapping[str, Any]) -> Any:
    hints = typing.get_type_hints(cls)
    return cls(**{k: _coerce(v, hints[k], k) for k, v in data.items()})
