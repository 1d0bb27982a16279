"""Codec contract: the error types, the abstract Codec interface and the name/wire-id registry."""

from __future__ import annotations

import abc
import sys
import threading
import warnings

import numpy as np
import torch

__all__ = [
    "Codec",
    "CodecError",
    "NonFiniteError",
    "UnknownCodecError",
    "as_byte_tensor",
    "codec_names",
    "get_codec",
    "register_codec",
]

# Every wire format here is defined as little-endian, and the codecs reinterpret tensor memory in place
# (uint8 <-> float32/float16 views) instead of byte-swapping, so a big-endian host would silently
# produce incompatible bytes. Refusing to import is better than corrupting a training run.
if sys.byteorder != "little":  # pragma: no cover - no big-endian CI
    raise ImportError("dreamp2p.compression requires a little-endian host")


class CodecError(ValueError):
    """Encoded data is malformed (wrong length, bad scale, bad type), or a codec was misused."""


class NonFiniteError(CodecError):
    """NaN/Inf in the input to encode, or data whose decoded values would not be finite."""


class UnknownCodecError(CodecError):
    """A codec name or wire id that no registered codec has."""


class Codec(abc.ABC):
    """One tensor wire format: turns a 1-D float32 tensor into bytes and back.

    Subclasses set the class attributes below. ``encode`` output length depends only on the element
    count, so a receiver that knows ``n`` can validate the payload size before touching it.
    """

    name: str
    wire_id: int
    lossless: bool
    # Element alignment: callers cut a flat tensor into chunks at multiples of ``block`` so that every
    # chunk quantizes exactly as it would inside the whole tensor.
    block: int
    # Byte granularity of one encoded value, used by the lossless stage's byte-shuffle.
    itemsize: int
    # Sends only some elements and decodes the rest as zero: fit for increments averaged with error
    # feedback (which carries the rest to the next round), never for parameters, which it would zero.
    sparse: bool = False

    @abc.abstractmethod
    def encoded_nbytes(self, n: int) -> int:
        """Exact length in bytes of ``encode`` output for ``n`` elements."""

    def wire_ratio(self) -> float:
        """Wire bytes per fp32 byte on a long buffer (fp32 1.0, bf16 0.5, int8 ~0.27), block overheads included."""
        n = 1 << 16
        return self.encoded_nbytes(n) / (4 * n)

    @abc.abstractmethod
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Encode a 1-D float32 CPU tensor into a new 1-D uint8 tensor of ``encoded_nbytes(x.numel())``."""

    @abc.abstractmethod
    def decode(
        self,
        data: torch.Tensor | bytes | bytearray | memoryview,
        n: int,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Decode ``n`` float32 elements from ``data`` (never mutated), into ``out`` when given."""

    def __repr__(self) -> str:
        return f"<codec {self.name} id={self.wire_id}>"

    # Shared validation used by every implementation.

    def _check_input(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise CodecError(f"{self.name}: expected a torch.Tensor, got {type(x).__name__}")
        if x.dtype != torch.float32:
            raise CodecError(f"{self.name}: expected float32 input, got {x.dtype}")
        if x.ndim != 1:
            raise CodecError(f"{self.name}: expected a 1-D tensor, got shape {tuple(x.shape)}")
        if x.device.type != "cpu":
            raise CodecError(f"{self.name}: expected a CPU tensor, got device {x.device}")
        # detach: encode writes into out= buffers, which autograd refuses for tensors that need grad.
        return x.detach().contiguous()

    def _check_n(self, n: int) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise CodecError(f"{self.name}: element count must be an int >= 0, got {n!r}")

    def _payload(self, data: torch.Tensor | bytes | bytearray | memoryview, n: int) -> torch.Tensor:
        self._check_n(n)
        buf = as_byte_tensor(data, self.name)
        expected = self.encoded_nbytes(n)
        if buf.numel() != expected:
            raise CodecError(f"{self.name}: expected {expected} bytes for {n} elements, got {buf.numel()}")
        return buf

    def _output(self, out: torch.Tensor | None, n: int) -> torch.Tensor:
        if out is None:
            return torch.empty(n, dtype=torch.float32)
        if out.dtype != torch.float32 or out.numel() != n or not out.is_contiguous():
            raise CodecError(
                f"{self.name}: out must be a contiguous float32 tensor of {n} elements, "
                f"got {out.dtype} with {out.numel()} elements (contiguous={out.is_contiguous()})"
            )
        if out.device.type != "cpu":
            raise CodecError(f"{self.name}: out must be a CPU tensor, got device {out.device}")
        return out.detach().view(-1)


def as_byte_tensor(data: torch.Tensor | bytes | bytearray | memoryview, who: str = "codec") -> torch.Tensor:
    """View ``data`` as a 1-D uint8 CPU tensor, sharing memory where the buffer allows it.

    The result may alias read-only memory (a ``bytes`` object): callers must only read it.
    """
    if isinstance(data, torch.Tensor):
        if data.dtype != torch.uint8:
            raise CodecError(f"{who}: encoded data must be a uint8 tensor, got {data.dtype}")
        if data.device.type != "cpu":
            raise CodecError(f"{who}: encoded data must be on the CPU, got device {data.device}")
        return data.detach().reshape(-1).contiguous()
    if isinstance(data, memoryview):
        if not data.c_contiguous:
            data = data.tobytes()
        elif data.format != "B" or data.ndim != 1:
            data = data.cast("B")
    elif not isinstance(data, bytes | bytearray):
        raise CodecError(f"{who}: encoded data must be a tensor or a bytes-like object, got {type(data).__name__}")
    arr = np.frombuffer(data, dtype=np.uint8)
    if arr.flags.writeable:
        return torch.from_numpy(arr)
    # torch warns that it cannot mark a tensor read-only; every caller here only reads, so the warning
    # is noise, and copying the payload just to silence it would cost a full pass.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(arr)


_registry_lock = threading.Lock()
_by_name: dict[str, Codec] = {}
_by_id: dict[int, Codec] = {}


def register_codec(codec: Codec) -> None:
    """Add ``codec`` to the registry; a name or wire id already taken is a ValueError."""
    if not isinstance(codec, Codec):
        raise TypeError(f"expected a Codec instance, got {type(codec).__name__}")
    key = codec.name.lower()
    with _registry_lock:
        if key in _by_name:
            raise ValueError(f"codec name {codec.name!r} is already registered")
        if codec.wire_id in _by_id:
            raise ValueError(f"codec wire id {codec.wire_id} is already registered to {_by_id[codec.wire_id].name!r}")
        _by_name[key] = codec
        _by_id[codec.wire_id] = codec


def codec_names() -> list[str]:
    """Names of all registered codecs, in wire-id order."""
    with _registry_lock:
        return [_by_id[i].name for i in sorted(_by_id)]


def get_codec(key: str | int) -> Codec:
    """Look a codec up by name (case-insensitive) or by wire id."""
    with _registry_lock:
        found: Codec | None = None
        if isinstance(key, str):
            found = _by_name.get(key.strip().lower())
        elif isinstance(key, int) and not isinstance(key, bool):
            found = _by_id.get(key)
        if found is not None:
            return found
        known = ", ".join(f"{_by_id[i].name}={i}" for i in sorted(_by_id))
    raise UnknownCodecError(f"unknown codec {key!r}; known codecs (name=wire id): {known}")
