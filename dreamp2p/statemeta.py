"""Wire-level description of a state snapshot and its validation: torch-free, so the transport can use it.

:class:`TensorMeta` and :class:`StateManifest` are what a donor announces; the ``check_*`` functions hold
the limits that bound what a donor can make a receiver allocate or parse (ValueError when exceeded).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

# The only dtypes that cross the wire, with their element sizes: plain fixed-size little-endian scalars.
DTYPE_ITEMSIZE: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float64": 8,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}

# A manifest of MAX_TENSORS entries with the longest names plus the largest skeleton fits a 64 MiB message.
MAX_TENSORS = 1 << 16
MAX_NAME_BYTES = 256
MAX_DIMS = 32
MAX_SKELETON_BYTES = 16 << 20
MAX_TOTAL_BYTES = 1 << 40
MAX_MANIFEST_HASH_BYTES = 64
SHA256_BYTES = 32
# Largest byte range one FetchState call may ask for: bounds the work one request can make a donor do.
MAX_RANGE_BYTES = 64 << 20
# Size of the messages a range is streamed in: well below the gRPC message limit, small enough to pace.
STREAM_CHUNK_BYTES = 4 << 20


@dataclass(frozen=True)
class TensorMeta:
    """What a receiver needs to validate and rebuild one tensor from raw bytes."""

    name: str
    dtype: str  # a key of DTYPE_ITEMSIZE
    shape: tuple[int, ...]
    nbytes: int
    sha256: bytes


@dataclass(frozen=True)
class StateManifest:
    """A donor's description of one snapshot: everything but the tensor bytes."""

    snapshot_id: int
    step: int
    skeleton: bytes
    tensors: tuple[TensorMeta, ...]
    manifest_hash: bytes = b""  # the donor's model manifest (see dreamp2p.manifest); filled at the wire

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def layout(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """name -> (dtype, shape): what two donors must agree on to be interchangeable."""
        return {t.name: (t.dtype, t.shape) for t in self.tensors}


def check_name(name: str) -> None:
    """A tensor name: non-empty, at most MAX_NAME_BYTES of UTF-8, no control characters."""
    if not isinstance(name, str) or not name:
        raise ValueError("tensor name is empty")
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:
        raise ValueError(f"tensor name {name!r} is not valid UTF-8") from None
    if size > MAX_NAME_BYTES:
        raise ValueError(f"tensor name of {size} bytes exceeds {MAX_NAME_BYTES}")
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in name):
        raise ValueError(f"tensor name {name!r} contains control characters")


def check_meta(meta: TensorMeta) -> None:
    """Raise ValueError unless ``meta`` is internally consistent and within the limits."""
    check_name(meta.name)
    itemsize = DTYPE_ITEMSIZE.get(meta.dtype)
    if itemsize is None:
        raise ValueError(f"tensor {meta.name!r}: dtype {meta.dtype!r} is not one of {', '.join(DTYPE_ITEMSIZE)}")
    if len(meta.shape) > MAX_DIMS:
        raise ValueError(f"tensor {meta.name!r}: {len(meta.shape)} dimensions exceed {MAX_DIMS}")
    numel = 1
    for d in meta.shape:
        if not isinstance(d, int) or isinstance(d, bool) or not 0 <= d <= MAX_TOTAL_BYTES:
            raise ValueError(f"tensor {meta.name!r}: shape {meta.shape} has a size outside 0..{MAX_TOTAL_BYTES}")
        numel *= d
    if numel * itemsize != meta.nbytes:
        raise ValueError(
            f"tensor {meta.name!r}: {meta.nbytes} bytes do not match shape {meta.shape} of {meta.dtype}"
            f" ({numel * itemsize} bytes)"
        )
    if meta.nbytes > MAX_TOTAL_BYTES:
        raise ValueError(f"tensor {meta.name!r}: {meta.nbytes} bytes exceed {MAX_TOTAL_BYTES}")
    if len(meta.sha256) != SHA256_BYTES:
        raise ValueError(f"tensor {meta.name!r}: sha256 has {len(meta.sha256)} bytes, not {SHA256_BYTES}")


def check_tensor_list(metas: Iterable[TensorMeta]) -> None:
    """Raise ValueError unless every entry is valid, names are unique and the totals are within limits."""
    names: set[str] = set()
    total = 0
    for i, meta in enumerate(metas):
        if i >= MAX_TENSORS:
            raise ValueError(f"more than {MAX_TENSORS} tensors")
        check_meta(meta)
        if meta.name in names:
            raise ValueError(f"tensor {meta.name!r} is listed twice")
        names.add(meta.name)
        total += meta.nbytes
        if total > MAX_TOTAL_BYTES:
            raise ValueError(f"tensors total more than {MAX_TOTAL_BYTES} bytes")


def check_manifest(m: StateManifest) -> None:
    """Raise ValueError unless a received manifest is structurally valid (the skeleton is parsed later)."""
    if m.snapshot_id == 0:
        raise ValueError("snapshot id 0 (unset)")
    if len(m.skeleton) > MAX_SKELETON_BYTES:
        raise ValueError(f"skeleton of {len(m.skeleton)} bytes exceeds {MAX_SKELETON_BYTES}")
    if not m.skeleton:
        raise ValueError("skeleton is empty")
    if len(m.manifest_hash) > MAX_MANIFEST_HASH_BYTES:
        raise ValueError(f"manifest hash of {len(m.manifest_hash)} bytes exceeds {MAX_MANIFEST_HASH_BYTES}")
    check_tensor_list(m.tensors)


@dataclass(frozen=True)
class StateRange:
    """One FetchState request: ``length`` bytes at ``offset`` of one tensor of one snapshot."""

    sender: str
    snapshot_id: int
    tensor: str
    offset: int
    length: int
