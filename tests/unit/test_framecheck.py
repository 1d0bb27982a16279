"""Checks of a frame for a round not open yet (`dreamp2p.collective.framecheck`): one case per rule."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from dreamp2p.collective.framecheck import MAX_GROUP_ELEMENTS, check_early_frame
from dreamp2p.collective.ring import checksum
from dreamp2p.compression import ZstdStage, get_codec
from dreamp2p.errors import PeerError, Status
from dreamp2p.messages import DType, Frame, Phase

MAX_PAYLOAD = 1 << 20
WORLD = 3


def frame(**fields: Any) -> Frame:
    """A frame no rule refuses: 64 fp32 elements at offset 64 of a 192-element group, checksum right."""
    payload = fields.pop("payload", bytes(256))
    base: dict[str, Any] = {
        "round_id": 7,
        "plan_version": 0,
        "group_id": 3,
        "phase": Phase.REDUCE_SCATTER,
        "ring_step": 0,
        "segment_index": 1,
        "chunk_offset": 64,
        "chunk_length": 64,
        "codec": get_codec("fp32").wire_id,
        "dtype": DType.FP32,
        "element_count": 192,
        "checksum": checksum(payload),
        "zstd": False,
        "raw_length": 0,
        "payload": payload,
        "sender": "p0",
    }
    base.update(fields)
    return Frame(**base)


def zstd_frame(**fields: Any) -> Frame:
    raw = bytes(4 * 64)
    packed = ZstdStage(1).compress(raw, 4)
    assert len(packed) < len(raw)
    return frame(**{"payload": packed, "zstd": True, "raw_length": len(raw), **fields})


@pytest.mark.parametrize(
    "f",
    [
        frame(),
        zstd_frame(),
        frame(phase=Phase.ALL_GATHER, ring_step=1, excluded=2),
        frame(chunk_offset=128),  # the chunk ends where the buffer does
        frame(codec=get_codec("fp16").wire_id, payload=bytes(128)),
        frame(ring_step=5, segment_index=9, excluded=6),  # world 0: the ring is not known yet, not checked
    ],
    ids=["fp32", "zstd", "all-gather", "last-chunk", "fp16", "no-ring"],
)
def test_a_frame_any_round_could_take_passes(f: Frame) -> None:
    world = 0 if f.ring_step == 5 else WORLD
    check_early_frame(f, world, MAX_PAYLOAD)


@pytest.mark.parametrize(
    ("f", "status", "detail"),
    [
        (frame(element_count=MAX_GROUP_ELEMENTS + 1), Status.BAD_FRAME, "element_count 68719476737 exceeds"),
        (frame(chunk_length=0, payload=b""), Status.BAD_FRAME, "chunk [64, 64) outside a buffer of 192"),
        (frame(chunk_offset=129), Status.BAD_FRAME, "chunk [129, 193) outside a buffer of 192"),
        (
            frame(chunk_offset=(1 << 64) - 10),
            Status.BAD_FRAME,
            f"chunk [{(1 << 64) - 10}, {(1 << 64) + 54}) outside a buffer of 192",
        ),
        (frame(ring_step=2), Status.BAD_FRAME, "ring_step 2 out of range for a ring of 3"),
        (frame(segment_index=3), Status.BAD_FRAME, "segment 3 out of range for a ring of 3"),
        (frame(excluded=2), Status.BAD_FRAME, "excluded 2 exceeds the contributions a REDUCE_SCATTER frame at step 0"),
        (frame(codec=250), Status.UNKNOWN_CODEC, "unknown codec id 250"),
        (
            frame(chunk_offset=0, chunk_length=1 << 20, element_count=1 << 21),
            Status.OVERSIZE,
            "1048576 fp32 elements need 4194304 bytes, over the 1048576 limit",
        ),
        (zstd_frame(raw_length=1 << 40), Status.BAD_FRAME, "raw_length 1099511627776, expected 256"),
        (frame(zstd=True, raw_length=256), Status.BAD_FRAME, "zstd payload of 256 bytes for 256 raw bytes"),
        (frame(payload=bytes(252)), Status.BAD_FRAME, "payload of 252 bytes for 64 fp32 elements; expected 256"),
        (frame(checksum=1), Status.CHECKSUM_MISMATCH, "payload checksum mismatch (256 bytes)"),
    ],
    ids=[
        "absurd-buffer",
        "empty-chunk",
        "past-the-end",
        "offset-near-2^64",
        "ring-step",
        "segment",
        "excluded",
        "codec",
        "over-the-size-limit",
        "zstd-raw-2^40",
        "zstd-not-smaller",
        "payload-size",
        "checksum",
    ],
)
def test_each_rule_refuses_with_its_status(f: Frame, status: Status, detail: str) -> None:
    with pytest.raises(PeerError) as info:
        check_early_frame(f, WORLD, MAX_PAYLOAD)
    assert info.value.status == status
    assert info.value.detail.startswith(detail), info.value.detail


def test_rules_run_before_the_checksum() -> None:
    """A wrong size is named even where the checksum is wrong too (no hashing of a payload that cannot fit)."""
    f = dataclasses.replace(frame(payload=bytes(252)), checksum=0)
    with pytest.raises(PeerError) as info:
        check_early_frame(f, WORLD, MAX_PAYLOAD)
    assert info.value.status == Status.BAD_FRAME
