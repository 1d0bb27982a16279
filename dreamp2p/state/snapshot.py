"""Pure encoding of a training state for transfer: a JSON skeleton plus raw, hashed tensor bytes.

A state is a nested structure of dicts (str or int keys; an OrderedDict keeps its type and the
``_metadata`` of a module's state_dict), lists, tuples, tensors, ints, floats, strings, bools and None,
such as ``{"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 12}``.
:func:`flatten_state` splits it into a skeleton (UTF-8 JSON: structure and non-tensor values, with each
tensor replaced by a reference to its name) and the named tensors; :func:`unflatten_state` rebuilds it.
Tensors travel as raw little-endian bytes described by a :class:`TensorMeta` (dtype from an allowlist,
shape, length, SHA-256); nothing is ever unpickled. Round trips are bitwise exact (NaN payloads
included). No I/O here: every function is a computation on values it is given.
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import math
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dreamp2p.statemeta import (
    MAX_SKELETON_BYTES,
    MAX_TENSORS,
    MAX_TOTAL_BYTES,
    StateManifest,
    TensorMeta,
    check_meta,
    check_name,
)

__all__ = [
    "DTYPES",
    "ChecksumMismatch",
    "Snapshot",
    "StateManifest",
    "TensorMeta",
    "capture_snapshot",
    "check_meta",
    "flatten_state",
    "skeleton_tensor_names",
    "tensor_from_bytes",
    "tensor_to_bytes",
    "unflatten_state",
]

log = logging.getLogger(__name__)

# The only dtypes that cross the wire (see meta.DTYPE_ITEMSIZE, which names the same ones).
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}

MAX_DEPTH = 64
SKELETON_FORMAT = "dreamp2p-state/1"
_TAGS = frozenset({"dict", "odict", "tuple", "tensor", "float_bits"})


class ChecksumMismatch(ValueError):
    """Received tensor bytes whose SHA-256 differs from the one announced for them."""


@dataclass(frozen=True, eq=False)
class Snapshot:
    """A captured state held by a donor: the manifest and a read-only view of every tensor's bytes."""

    manifest: StateManifest
    data: Mapping[str, memoryview]

    @property
    def snapshot_id(self) -> int:
        return self.manifest.snapshot_id

    @property
    def step(self) -> int:
        return self.manifest.step


def _segment(key: str | int) -> str:
    """One path segment; '%' and '/' are escaped so a key cannot forge another path."""
    text = str(key)
    return "".join(f"%{ord(c):02X}" if c in "%/" or ord(c) < 0x20 or ord(c) == 0x7F else c for c in text)


# ---------------------------------------------------------------------------------------------- tensors


def _wire_tensor(t: torch.Tensor, what: str) -> str:
    """The dtype name of a tensor that may be serialized; TypeError for anything else."""
    if t.layout != torch.strided:
        raise TypeError(f"{what}: {t.layout} tensors cannot be transferred, only dense ones")
    if t.is_quantized or t.device.type == "meta":
        raise TypeError(f"{what}: quantized or meta tensors cannot be transferred")
    name = _DTYPE_NAMES.get(t.dtype)
    if name is None:
        raise TypeError(f"{what}: dtype {t.dtype} is not one of {', '.join(DTYPES)}")
    return name


def tensor_to_bytes(name: str, t: torch.Tensor) -> tuple[TensorMeta, memoryview]:
    """Metadata (with SHA-256) and a read-only byte view of ``t`` as a contiguous CPU tensor.

    Copies only when ``t`` is not already contiguous on the CPU; the view keeps that tensor alive, so a
    caller that will keep mutating ``t`` must pass a copy (see :func:`capture_snapshot`).
    """
    check_name(name)
    dtype = _wire_tensor(t, f"tensor {name!r}")
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    data = flat.view(torch.uint8).numpy().data.toreadonly()
    meta = TensorMeta(name, dtype, tuple(int(d) for d in t.shape), len(data), hashlib.sha256(data).digest())
    return meta, data


def tensor_from_bytes(meta: TensorMeta, data: bytes | bytearray | memoryview, verify: bool = True) -> torch.Tensor:
    """Rebuild a tensor from its raw bytes; ValueError (ChecksumMismatch for the hash) on any disagreement.

    The result owns fresh memory: it never aliases ``data``.
    """
    check_meta(meta)
    view = memoryview(data).cast("B")
    if len(view) != meta.nbytes:
        raise ValueError(f"tensor {meta.name!r}: got {len(view)} bytes, expected {meta.nbytes}")
    if verify and hashlib.sha256(view).digest() != meta.sha256:
        raise ChecksumMismatch(f"tensor {meta.name!r}: SHA-256 of the received bytes differs from the manifest")
    raw = torch.empty(meta.nbytes, dtype=torch.uint8)
    if meta.nbytes:
        raw.numpy()[:] = np.frombuffer(view, dtype=np.uint8)
    if meta.dtype == "bool" and meta.nbytes and int(raw.max()) > 1:
        raise ValueError(f"tensor {meta.name!r}: bool tensor holds bytes other than 0 and 1")
    return raw.view(DTYPES[meta.dtype]).reshape(meta.shape)


# ---------------------------------------------------------------------------------------------- skeleton


def flatten_state(state: Any) -> tuple[bytes, list[tuple[str, torch.Tensor]]]:
    """Split ``state`` into its JSON skeleton and its (name, tensor) pairs, in traversal order.

    Tensors are returned as given (detached, not copied). Raises TypeError for a value of another type
    (with its path) and ValueError when a limit is exceeded.
    """
    tensors: list[tuple[str, torch.Tensor]] = []
    used: set[str] = set()
    total = 0

    def name_for(path: tuple[str, ...]) -> str:
        candidate = "/".join(path) or "tensor"
        try:
            check_name(candidate)
        except ValueError:
            candidate = ""
        n = len(tensors)
        while not candidate or candidate in used:
            # an over-long or colliding path (int key 0 beside str key "0") gets a numbered name
            candidate = f"tensor#{n}"
            n += 1
        return candidate

    def encode(value: Any, path: tuple[str, ...], depth: int) -> Any:
        nonlocal total
        where = "/".join(path) or "<root>"
        if depth > MAX_DEPTH:
            raise ValueError(f"state nests deeper than {MAX_DEPTH} levels at {where}")
        if value is None or isinstance(value, bool | str):
            return value
        if isinstance(value, int):
            return value
        if isinstance(value, float):
            if math.isfinite(value):
                return value
            # JSON has no NaN/Inf: keep the exact IEEE bits (sign and NaN payload included)
            return {"float_bits": struct.pack(">d", value).hex()}
        if isinstance(value, torch.Tensor):
            _wire_tensor(value, f"tensor at {where}")
            if len(tensors) >= MAX_TENSORS:
                raise ValueError(f"state holds more than {MAX_TENSORS} tensors")
            total += value.numel() * value.element_size()
            if total > MAX_TOTAL_BYTES:
                raise ValueError(f"state tensors total more than {MAX_TOTAL_BYTES} bytes")
            name = name_for(path)
            used.add(name)
            tensors.append((name, value.detach()))
            return {"tensor": name}
        if isinstance(value, dict):
            pairs = []
            for k, v in value.items():
                if isinstance(k, bool) or not isinstance(k, str | int):
                    raise TypeError(f"dict key {k!r} at {where} is a {type(k).__name__}, not str or int")
                pairs.append([k, encode(v, (*path, _segment(k)), depth + 1)])
            if isinstance(value, collections.OrderedDict):
                # a module's state_dict: load_state_dict reads the per-module versions in its _metadata
                extra = getattr(value, "_metadata", None)
                meta = encode(extra, (*path, "_metadata"), depth + 1) if isinstance(extra, dict) else None
                return {"odict": [pairs, meta]}
            return {"dict": pairs}
        if isinstance(value, list):
            return [encode(v, (*path, str(i)), depth + 1) for i, v in enumerate(value)]
        if isinstance(value, tuple):
            return {"tuple": [encode(v, (*path, str(i)), depth + 1) for i, v in enumerate(value)]}
        raise TypeError(f"value at {where} is a {type(value).__name__}, which a state cannot hold")

    root = encode(state, (), 0)
    try:
        text = json.dumps({"format": SKELETON_FORMAT, "root": root}, ensure_ascii=True, allow_nan=False)
    except ValueError as exc:  # e.g. an int beyond Python's int-to-str digit limit
        raise ValueError(f"state cannot be encoded as JSON: {exc}") from None
    skeleton = text.encode("ascii")
    if len(skeleton) > MAX_SKELETON_BYTES:
        raise ValueError(f"state skeleton of {len(skeleton)} bytes exceeds {MAX_SKELETON_BYTES}")
    return skeleton, tensors


def _reject_constant(name: str) -> Any:
    raise ValueError(f"skeleton holds the non-standard JSON constant {name}")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"skeleton number {text[:40]} overflows a float")
    return value


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"skeleton object repeats key {k!r}")
        out[k] = v
    return out


def _parse(skeleton: bytes) -> Any:
    if len(skeleton) > MAX_SKELETON_BYTES:
        raise ValueError(f"skeleton of {len(skeleton)} bytes exceeds {MAX_SKELETON_BYTES}")
    try:
        text = bytes(skeleton).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"skeleton is not UTF-8: {exc}") from None
    try:
        doc = json.loads(
            text, parse_constant=_reject_constant, parse_float=_finite_float, object_pairs_hook=_unique_pairs
        )
    except RecursionError:
        raise ValueError("skeleton nests too deeply") from None
    except ValueError as exc:  # JSONDecodeError and the hooks above
        raise ValueError(f"skeleton is not valid JSON: {exc}") from None
    if not isinstance(doc, dict) or set(doc) != {"format", "root"}:
        raise ValueError("skeleton must be an object with exactly the keys 'format' and 'root'")
    if doc["format"] != SKELETON_FORMAT:
        raise ValueError(f"skeleton format {doc['format']!r} is not {SKELETON_FORMAT!r}")
    return doc["root"]


def _decode(node: Any, tensor: Callable[[str], Any], depth: int, where: str) -> Any:
    if depth > MAX_DEPTH:
        raise ValueError(f"skeleton nests deeper than {MAX_DEPTH} levels at {where}")
    if node is None or isinstance(node, bool | int | float | str):
        return node
    if isinstance(node, list):
        return [_decode(v, tensor, depth + 1, f"{where}/{i}") for i, v in enumerate(node)]
    if not isinstance(node, dict) or len(node) != 1 or next(iter(node)) not in _TAGS:
        raise ValueError(f"skeleton node at {where} is an object but not one tagged with one of {sorted(_TAGS)}")
    tag, body = next(iter(node.items()))
    if tag == "tensor":
        if not isinstance(body, str):
            raise ValueError(f"tensor reference at {where} is not a string")
        return tensor(body)
    if tag == "float_bits":
        if not isinstance(body, str) or len(body) != 16 or any(c not in "0123456789abcdef" for c in body):
            raise ValueError(f"float_bits at {where} is not 16 lowercase hex digits")
        value: float = struct.unpack(">d", bytes.fromhex(body))[0]
        if math.isfinite(value):
            raise ValueError(f"float_bits at {where} encodes a finite number, which must be a plain JSON number")
        return value
    if tag == "tuple":
        if not isinstance(body, list):
            raise ValueError(f"tuple at {where} is not a JSON array")
        return tuple(_decode(v, tensor, depth + 1, f"{where}/{i}") for i, v in enumerate(body))
    if tag == "odict":
        if not isinstance(body, list) or len(body) != 2:
            raise ValueError(f"odict at {where} is not a JSON array of [pairs, metadata]")
        ordered: collections.OrderedDict[str | int, Any] = collections.OrderedDict(
            _decode_pairs(body[0], tensor, depth, where)
        )
        if body[1] is not None:
            extra = _decode(body[1], tensor, depth + 1, f"{where}/_metadata")
            if not isinstance(extra, dict):
                raise ValueError(f"odict metadata at {where} is not a dict")
            ordered._metadata = extra  # type: ignore[attr-defined]  # as torch's state_dict() sets it
        return ordered
    return _decode_pairs(body, tensor, depth, where)


def _decode_pairs(body: Any, tensor: Callable[[str], Any], depth: int, where: str) -> dict[str | int, Any]:
    if not isinstance(body, list):
        raise ValueError(f"dict at {where} is not a JSON array of [key, value] pairs")
    out: dict[str | int, Any] = {}
    for pair in body:
        if not isinstance(pair, list) or len(pair) != 2:
            raise ValueError(f"dict entry at {where} is not a [key, value] pair")
        key, value = pair
        if isinstance(key, bool) or not isinstance(key, str | int):
            raise ValueError(f"dict key {key!r} at {where} is not a string or an integer")
        if key in out:
            raise ValueError(f"dict at {where} repeats key {key!r}")
        out[key] = _decode(value, tensor, depth + 1, f"{where}/{_segment(key)}")
    return out


def skeleton_tensor_names(skeleton: bytes) -> list[str]:
    """Validate ``skeleton`` and list the tensor names it refers to, in order (ValueError if malformed)."""
    names: list[str] = []
    seen: set[str] = set()

    def collect(name: str) -> None:
        check_name(name)
        if name in seen:
            raise ValueError(f"skeleton refers to tensor {name!r} twice")
        seen.add(name)
        names.append(name)

    _decode(_parse(skeleton), collect, 0, "")
    return names


def unflatten_state(skeleton: bytes, tensors: Mapping[str, torch.Tensor]) -> Any:
    """Rebuild the state ``flatten_state`` split; every tensor must be referenced exactly once."""
    taken: set[str] = set()

    def lookup(name: str) -> torch.Tensor:
        if name in taken:
            raise ValueError(f"skeleton refers to tensor {name!r} twice")
        if name not in tensors:
            raise ValueError(f"skeleton refers to tensor {name!r}, which was not supplied")
        taken.add(name)
        return tensors[name]

    state = _decode(_parse(skeleton), lookup, 0, "")
    extra = [n for n in tensors if n not in taken]
    if extra:
        shown = ", ".join(repr(n) for n in extra[:5])
        raise ValueError(f"{len(extra)} supplied tensor(s) not referenced by the skeleton: {shown}")
    return state


# ---------------------------------------------------------------------------------------------- capture


def _owned_copy(t: torch.Tensor) -> torch.Tensor:
    """Exactly one copy of ``t`` into fresh contiguous CPU memory (a device tensor is copied once, not twice)."""
    out = torch.empty(tuple(t.shape), dtype=t.dtype, device="cpu")
    out.copy_(t.detach())
    return out


def capture_snapshot(state: Any, step: int, snapshot_id: int) -> Snapshot:
    """Copy, flatten and hash ``state`` now; the result shares no memory with it."""
    if not 0 <= step < 1 << 64:
        raise ValueError(f"step {step} does not fit an unsigned 64-bit integer")
    if not 0 < snapshot_id < 1 << 64:
        raise ValueError(f"snapshot id {snapshot_id} must be a non-zero unsigned 64-bit integer")
    skeleton, named = flatten_state(state)
    metas: list[TensorMeta] = []
    data: dict[str, memoryview] = {}
    for name, t in named:
        meta, view = tensor_to_bytes(name, _owned_copy(t))
        metas.append(meta)
        data[name] = view
    manifest = StateManifest(snapshot_id=snapshot_id, step=step, skeleton=skeleton, tensors=tuple(metas))
    return Snapshot(manifest=manifest, data=data)
