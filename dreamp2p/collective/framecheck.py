"""Checks of a frame that need no open round: what it says about itself must add up before it may wait.

A frame can arrive before its round opens here (a faster member started it); it then waits, holding its
payload, until the round opens (`peer.rounds`). The round's layout is not known yet, so the full check
(`collective.ring.RingRound._validate`) cannot run; this one refuses at once, with the precise status,
every frame that no round could accept: a chunk outside the buffer it names, an absurd buffer, a payload
whose size does not match its codec and chunk length (or whose zstd raw length does not), a payload over
the size limit once decoded, a wrong checksum, a ring step or segment beyond the ring. Pure.
"""

from __future__ import annotations

from dreamp2p.collective.ring import checksum
from dreamp2p.compression import get_codec
from dreamp2p.compression.base import UnknownCodecError
from dreamp2p.errors import PeerError, Status
from dreamp2p.messages import Frame, Phase

# Elements one group buffer may have (2^36 fp32 values: 256 GiB, beyond any model this library trains).
MAX_GROUP_ELEMENTS = 1 << 36


def check_early_frame(f: Frame, world: int, max_payload: int) -> None:
    """Refuse (PeerError) a frame for a round not open here that no round among ``world`` members could
    accept; ``world`` 0: the ring is not known yet (not checked). ``max_payload``: the bytes limit of one
    frame's payload, raw (before zstd) included."""
    if f.element_count > MAX_GROUP_ELEMENTS:
        raise PeerError(Status.BAD_FRAME, f"element_count {f.element_count} exceeds {MAX_GROUP_ELEMENTS}")
    if f.chunk_length == 0 or f.chunk_offset + f.chunk_length > f.element_count:
        raise PeerError(
            Status.BAD_FRAME,
            f"chunk [{f.chunk_offset}, {f.chunk_offset + f.chunk_length}) outside a buffer of {f.element_count}",
        )
    if world:
        if f.ring_step >= world - 1:
            raise PeerError(Status.BAD_FRAME, f"ring_step {f.ring_step} out of range for a ring of {world}")
        if f.segment_index >= world:
            raise PeerError(Status.BAD_FRAME, f"segment {f.segment_index} out of range for a ring of {world}")
        most = f.ring_step + 1 if f.phase == Phase.REDUCE_SCATTER else world - 1
        if f.excluded > most:
            raise PeerError(
                Status.BAD_FRAME,
                f"excluded {f.excluded} exceeds the contributions a {f.phase.name} frame at step {f.ring_step} "
                "can carry",
            )
    try:
        codec = get_codec(f.codec)
    except UnknownCodecError:
        raise PeerError(Status.UNKNOWN_CODEC, f"unknown codec id {f.codec}") from None
    need = codec.encoded_nbytes(f.chunk_length)
    if need > max_payload:
        raise PeerError(
            Status.OVERSIZE, f"{f.chunk_length} {codec.name} elements need {need} bytes, over the {max_payload} limit"
        )
    if f.zstd:
        if f.raw_length != need:
            raise PeerError(Status.BAD_FRAME, f"raw_length {f.raw_length}, expected {need}")
        if len(f.payload) >= need:  # zstd is used only where it makes the payload smaller
            raise PeerError(Status.BAD_FRAME, f"zstd payload of {len(f.payload)} bytes for {need} raw bytes")
    elif len(f.payload) != need:
        raise PeerError(
            Status.BAD_FRAME,
            f"payload of {len(f.payload)} bytes for {f.chunk_length} {codec.name} elements; expected {need}",
        )
    if checksum(f.payload) != f.checksum:
        raise PeerError(Status.CHECKSUM_MISMATCH, f"payload checksum mismatch ({len(f.payload)} bytes)")
