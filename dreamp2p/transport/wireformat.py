"""The protobuf wire format written and read by hand, for the two messages that carry bulk bytes.

A ``DataFrame`` (ring data) and a ``StateChunk`` (state transfer) are serialized with their bulk bytes
copied once, and a received ``DataFrame`` is split into its header fields and a view of its payload
without copying the payload. Everything here is the standard encoding, so any protobuf library reads
what we write and we read what any of them writes. `transport.serde` (the single proto boundary) is the
only user; malformed input raises PeerError(BAD_FRAME).
"""

from __future__ import annotations

from dreamp2p.errors import PeerError, Status

# DataFrame.payload is field 15, length-delimited: tag byte (15 << 3) | 2.
PAYLOAD_FIELD = 15
PAYLOAD_TAG = bytes([(PAYLOAD_FIELD << 3) | 2])
# StateChunk: offset is field 1 (varint), data is field 2 (length-delimited).
CHUNK_OFFSET_TAG = bytes([(1 << 3) | 0])
CHUNK_DATA_TAG = bytes([(2 << 3) | 2])


def varint(n: int) -> bytes:
    """The base-128 varint encoding of ``n`` >= 0 (least significant group first)."""
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    """The varint at ``buf[pos:]`` and the position after it; BAD_FRAME if truncated or over 10 bytes."""
    result = 0
    shift = 0
    while True:
        if pos >= len(buf):
            raise PeerError(Status.BAD_FRAME, "truncated message: varint runs past the end")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift >= 64:
            raise PeerError(Status.BAD_FRAME, "malformed message: varint longer than 10 bytes")


def split_payload(data: bytes) -> tuple[bytes, memoryview]:
    """Split a serialized ``DataFrame`` into (header fields, payload view) without copying the payload.

    Accepts any valid field order (as any protobuf library may emit); a repeated payload field keeps
    the last one, as protobuf parsing does. Malformed input raises PeerError(BAD_FRAME).
    """
    mv = memoryview(data)
    end = len(mv)
    pos = 0
    spans: list[memoryview] = []
    payload = mv[0:0]
    while pos < end:
        start = pos
        key, pos = read_varint(mv, pos)
        field, wire_type = key >> 3, key & 7
        if field == 0:
            raise PeerError(Status.BAD_FRAME, "malformed message: field number 0")
        if wire_type == 0:
            _, pos = read_varint(mv, pos)
        elif wire_type == 1:
            pos += 8
        elif wire_type == 5:
            pos += 4
        elif wire_type == 2:
            length, pos = read_varint(mv, pos)
            if pos + length > end:
                raise PeerError(Status.BAD_FRAME, f"truncated message: field {field} needs {length} bytes")
            if field == PAYLOAD_FIELD:
                payload = mv[pos : pos + length]
                pos += length
                continue
            pos += length
        else:
            raise PeerError(Status.BAD_FRAME, f"malformed message: wire type {wire_type} of field {field}")
        if pos > end:
            raise PeerError(Status.BAD_FRAME, f"truncated message in field {field}")
        spans.append(mv[start:pos])
    return b"".join(spans), payload
