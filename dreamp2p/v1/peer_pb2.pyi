from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StatusCode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STATUS_UNSPECIFIED: _ClassVar[StatusCode]
    STATUS_OK: _ClassVar[StatusCode]
    STATUS_BAD_FRAME: _ClassVar[StatusCode]
    STATUS_UNKNOWN_CODEC: _ClassVar[StatusCode]
    STATUS_STALE_ROUND: _ClassVar[StatusCode]
    STATUS_OVERSIZE: _ClassVar[StatusCode]
    STATUS_NON_FINITE: _ClassVar[StatusCode]
    STATUS_CHECKSUM_MISMATCH: _ClassVar[StatusCode]
    STATUS_BAD_TOKEN: _ClassVar[StatusCode]
    STATUS_CLUSTER_MISMATCH: _ClassVar[StatusCode]
    STATUS_VERSION_MISMATCH: _ClassVar[StatusCode]
    STATUS_MANIFEST_MISMATCH: _ClassVar[StatusCode]
    STATUS_UNKNOWN_PEER: _ClassVar[StatusCode]
    STATUS_TIMEOUT: _ClassVar[StatusCode]
    STATUS_SHUTTING_DOWN: _ClassVar[StatusCode]
    STATUS_DUPLICATE_CHUNK: _ClassVar[StatusCode]
    STATUS_NEEDS_HANDSHAKE: _ClassVar[StatusCode]
    STATUS_VIEW_MISMATCH: _ClassVar[StatusCode]
    STATUS_NOT_FOUND: _ClassVar[StatusCode]
    STATUS_JOINING: _ClassVar[StatusCode]
    STATUS_CONFIG_MISMATCH: _ClassVar[StatusCode]
    STATUS_IDENTITY_MISMATCH: _ClassVar[StatusCode]
    STATUS_ROUND_COMPLETED: _ClassVar[StatusCode]

class Codec(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CODEC_UNSPECIFIED: _ClassVar[Codec]
    CODEC_FP32: _ClassVar[Codec]
    CODEC_FP16: _ClassVar[Codec]
    CODEC_BF16: _ClassVar[Codec]
    CODEC_INT8: _ClassVar[Codec]
    CODEC_INT4: _ClassVar[Codec]
    CODEC_E3M0: _ClassVar[Codec]
    CODEC_TOPK: _ClassVar[Codec]
    CODEC_INT2: _ClassVar[Codec]

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FP32: _ClassVar[DType]
    DTYPE_FP16: _ClassVar[DType]
    DTYPE_BF16: _ClassVar[DType]

class Phase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PHASE_UNSPECIFIED: _ClassVar[Phase]
    PHASE_REDUCE_SCATTER: _ClassVar[Phase]
    PHASE_ALL_GATHER: _ClassVar[Phase]
STATUS_UNSPECIFIED: StatusCode
STATUS_OK: StatusCode
STATUS_BAD_FRAME: StatusCode
STATUS_UNKNOWN_CODEC: StatusCode
STATUS_STALE_ROUND: StatusCode
STATUS_OVERSIZE: StatusCode
STATUS_NON_FINITE: StatusCode
STATUS_CHECKSUM_MISMATCH: StatusCode
STATUS_BAD_TOKEN: StatusCode
STATUS_CLUSTER_MISMATCH: StatusCode
STATUS_VERSION_MISMATCH: StatusCode
STATUS_MANIFEST_MISMATCH: StatusCode
STATUS_UNKNOWN_PEER: StatusCode
STATUS_TIMEOUT: StatusCode
STATUS_SHUTTING_DOWN: StatusCode
STATUS_DUPLICATE_CHUNK: StatusCode
STATUS_NEEDS_HANDSHAKE: StatusCode
STATUS_VIEW_MISMATCH: StatusCode
STATUS_NOT_FOUND: StatusCode
STATUS_JOINING: StatusCode
STATUS_CONFIG_MISMATCH: StatusCode
STATUS_IDENTITY_MISMATCH: StatusCode
STATUS_ROUND_COMPLETED: StatusCode
CODEC_UNSPECIFIED: Codec
CODEC_FP32: Codec
CODEC_FP16: Codec
CODEC_BF16: Codec
CODEC_INT8: Codec
CODEC_INT4: Codec
CODEC_E3M0: Codec
CODEC_TOPK: Codec
CODEC_INT2: Codec
DTYPE_UNSPECIFIED: DType
DTYPE_FP32: DType
DTYPE_FP16: DType
DTYPE_BF16: DType
PHASE_UNSPECIFIED: Phase
PHASE_REDUCE_SCATTER: Phase
PHASE_ALL_GATHER: Phase

class HandshakeRequest(_message.Message):
    __slots__ = ("cluster_id", "protocol_version", "node_id", "manifest_hash", "codecs", "advertise_address", "settings")
    class SettingsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    CLUSTER_ID_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_HASH_FIELD_NUMBER: _ClassVar[int]
    CODECS_FIELD_NUMBER: _ClassVar[int]
    ADVERTISE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SETTINGS_FIELD_NUMBER: _ClassVar[int]
    cluster_id: str
    protocol_version: int
    node_id: str
    manifest_hash: bytes
    codecs: _containers.RepeatedScalarFieldContainer[Codec]
    advertise_address: str
    settings: _containers.ScalarMap[str, str]
    def __init__(self, cluster_id: _Optional[str] = ..., protocol_version: _Optional[int] = ..., node_id: _Optional[str] = ..., manifest_hash: _Optional[bytes] = ..., codecs: _Optional[_Iterable[_Union[Codec, str]]] = ..., advertise_address: _Optional[str] = ..., settings: _Optional[_Mapping[str, str]] = ...) -> None: ...

class HandshakeResponse(_message.Message):
    __slots__ = ("status", "detail", "node_id", "protocol_version", "codecs", "manifest_hash", "settings")
    class SettingsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    STATUS_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    CODECS_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_HASH_FIELD_NUMBER: _ClassVar[int]
    SETTINGS_FIELD_NUMBER: _ClassVar[int]
    status: StatusCode
    detail: str
    node_id: str
    protocol_version: int
    codecs: _containers.RepeatedScalarFieldContainer[Codec]
    manifest_hash: bytes
    settings: _containers.ScalarMap[str, str]
    def __init__(self, status: _Optional[_Union[StatusCode, str]] = ..., detail: _Optional[str] = ..., node_id: _Optional[str] = ..., protocol_version: _Optional[int] = ..., codecs: _Optional[_Iterable[_Union[Codec, str]]] = ..., manifest_hash: _Optional[bytes] = ..., settings: _Optional[_Mapping[str, str]] = ...) -> None: ...

class DataFrame(_message.Message):
    __slots__ = ("round_id", "plan_version", "group_id", "phase", "ring_step", "segment_index", "chunk_offset", "chunk_length", "codec", "dtype", "element_count", "checksum", "zstd", "raw_length", "payload", "sender", "excluded", "view_id")
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    PLAN_VERSION_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    RING_STEP_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_INDEX_FIELD_NUMBER: _ClassVar[int]
    CHUNK_OFFSET_FIELD_NUMBER: _ClassVar[int]
    CHUNK_LENGTH_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    ELEMENT_COUNT_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    ZSTD_FIELD_NUMBER: _ClassVar[int]
    RAW_LENGTH_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    EXCLUDED_FIELD_NUMBER: _ClassVar[int]
    VIEW_ID_FIELD_NUMBER: _ClassVar[int]
    round_id: int
    plan_version: int
    group_id: int
    phase: Phase
    ring_step: int
    segment_index: int
    chunk_offset: int
    chunk_length: int
    codec: Codec
    dtype: DType
    element_count: int
    checksum: int
    zstd: bool
    raw_length: int
    payload: bytes
    sender: str
    excluded: int
    view_id: int
    def __init__(self, round_id: _Optional[int] = ..., plan_version: _Optional[int] = ..., group_id: _Optional[int] = ..., phase: _Optional[_Union[Phase, str]] = ..., ring_step: _Optional[int] = ..., segment_index: _Optional[int] = ..., chunk_offset: _Optional[int] = ..., chunk_length: _Optional[int] = ..., codec: _Optional[_Union[Codec, str]] = ..., dtype: _Optional[_Union[DType, str]] = ..., element_count: _Optional[int] = ..., checksum: _Optional[int] = ..., zstd: _Optional[bool] = ..., raw_length: _Optional[int] = ..., payload: _Optional[bytes] = ..., sender: _Optional[str] = ..., excluded: _Optional[int] = ..., view_id: _Optional[int] = ...) -> None: ...

class PushAck(_message.Message):
    __slots__ = ("status", "detail", "frames", "payload_bytes")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    status: StatusCode
    detail: str
    frames: int
    payload_bytes: int
    def __init__(self, status: _Optional[_Union[StatusCode, str]] = ..., detail: _Optional[str] = ..., frames: _Optional[int] = ..., payload_bytes: _Optional[int] = ...) -> None: ...

class ProbeRequest(_message.Message):
    __slots__ = ("nonce", "burst", "reply_bytes", "sender")
    NONCE_FIELD_NUMBER: _ClassVar[int]
    BURST_FIELD_NUMBER: _ClassVar[int]
    REPLY_BYTES_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    nonce: int
    burst: bytes
    reply_bytes: int
    sender: str
    def __init__(self, nonce: _Optional[int] = ..., burst: _Optional[bytes] = ..., reply_bytes: _Optional[int] = ..., sender: _Optional[str] = ...) -> None: ...

class ProbeResponse(_message.Message):
    __slots__ = ("nonce", "received_bytes", "burst", "has_progress", "step", "plan_version", "plan_effective_step", "plan_digest", "joining", "schedule_step", "schedule_digest")
    NONCE_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    BURST_FIELD_NUMBER: _ClassVar[int]
    HAS_PROGRESS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    PLAN_VERSION_FIELD_NUMBER: _ClassVar[int]
    PLAN_EFFECTIVE_STEP_FIELD_NUMBER: _ClassVar[int]
    PLAN_DIGEST_FIELD_NUMBER: _ClassVar[int]
    JOINING_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_STEP_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    nonce: int
    received_bytes: int
    burst: bytes
    has_progress: bool
    step: int
    plan_version: int
    plan_effective_step: int
    plan_digest: int
    joining: bool
    schedule_step: int
    schedule_digest: int
    def __init__(self, nonce: _Optional[int] = ..., received_bytes: _Optional[int] = ..., burst: _Optional[bytes] = ..., has_progress: _Optional[bool] = ..., step: _Optional[int] = ..., plan_version: _Optional[int] = ..., plan_effective_step: _Optional[int] = ..., plan_digest: _Optional[int] = ..., joining: _Optional[bool] = ..., schedule_step: _Optional[int] = ..., schedule_digest: _Optional[int] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LinkStats(_message.Message):
    __slots__ = ("peer", "rtt_s", "goodput_bytes_per_s", "bytes_sent", "bytes_received", "samples", "chunk_bytes")
    PEER_FIELD_NUMBER: _ClassVar[int]
    RTT_S_FIELD_NUMBER: _ClassVar[int]
    GOODPUT_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    peer: str
    rtt_s: float
    goodput_bytes_per_s: float
    bytes_sent: int
    bytes_received: int
    samples: int
    chunk_bytes: int
    def __init__(self, peer: _Optional[str] = ..., rtt_s: _Optional[float] = ..., goodput_bytes_per_s: _Optional[float] = ..., bytes_sent: _Optional[int] = ..., bytes_received: _Optional[int] = ..., samples: _Optional[int] = ..., chunk_bytes: _Optional[int] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("node_id", "cluster_id", "protocol_version", "ring", "links", "rounds_completed", "rounds_failed", "frames_rejected", "codecs", "uptime_s", "step", "plan_version", "plan_effective_step", "plan_summary", "strategy", "resuming", "checkpoint_steps", "contributions_refused", "live", "view_id", "excluded", "straggler_evictions", "straggler_returns", "region_rank", "region_ranks")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_ID_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    RING_FIELD_NUMBER: _ClassVar[int]
    LINKS_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_COMPLETED_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FAILED_FIELD_NUMBER: _ClassVar[int]
    FRAMES_REJECTED_FIELD_NUMBER: _ClassVar[int]
    CODECS_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    PLAN_VERSION_FIELD_NUMBER: _ClassVar[int]
    PLAN_EFFECTIVE_STEP_FIELD_NUMBER: _ClassVar[int]
    PLAN_SUMMARY_FIELD_NUMBER: _ClassVar[int]
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    RESUMING_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_STEPS_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTIONS_REFUSED_FIELD_NUMBER: _ClassVar[int]
    LIVE_FIELD_NUMBER: _ClassVar[int]
    VIEW_ID_FIELD_NUMBER: _ClassVar[int]
    EXCLUDED_FIELD_NUMBER: _ClassVar[int]
    STRAGGLER_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    STRAGGLER_RETURNS_FIELD_NUMBER: _ClassVar[int]
    REGION_RANK_FIELD_NUMBER: _ClassVar[int]
    REGION_RANKS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    cluster_id: str
    protocol_version: int
    ring: _containers.RepeatedScalarFieldContainer[str]
    links: _containers.RepeatedCompositeFieldContainer[LinkStats]
    rounds_completed: int
    rounds_failed: int
    frames_rejected: int
    codecs: _containers.RepeatedScalarFieldContainer[Codec]
    uptime_s: float
    step: int
    plan_version: int
    plan_effective_step: int
    plan_summary: str
    strategy: str
    resuming: bool
    checkpoint_steps: _containers.RepeatedScalarFieldContainer[int]
    contributions_refused: int
    live: _containers.RepeatedScalarFieldContainer[str]
    view_id: int
    excluded: _containers.RepeatedScalarFieldContainer[str]
    straggler_evictions: int
    straggler_returns: int
    region_rank: int
    region_ranks: int
    def __init__(self, node_id: _Optional[str] = ..., cluster_id: _Optional[str] = ..., protocol_version: _Optional[int] = ..., ring: _Optional[_Iterable[str]] = ..., links: _Optional[_Iterable[_Union[LinkStats, _Mapping]]] = ..., rounds_completed: _Optional[int] = ..., rounds_failed: _Optional[int] = ..., frames_rejected: _Optional[int] = ..., codecs: _Optional[_Iterable[_Union[Codec, str]]] = ..., uptime_s: _Optional[float] = ..., step: _Optional[int] = ..., plan_version: _Optional[int] = ..., plan_effective_step: _Optional[int] = ..., plan_summary: _Optional[str] = ..., strategy: _Optional[str] = ..., resuming: _Optional[bool] = ..., checkpoint_steps: _Optional[_Iterable[int]] = ..., contributions_refused: _Optional[int] = ..., live: _Optional[_Iterable[str]] = ..., view_id: _Optional[int] = ..., excluded: _Optional[_Iterable[str]] = ..., straggler_evictions: _Optional[int] = ..., straggler_returns: _Optional[int] = ..., region_rank: _Optional[int] = ..., region_ranks: _Optional[int] = ...) -> None: ...

class VoteRequest(_message.Message):
    __slots__ = ("sender", "group_id", "round_id", "view_id", "commit", "sent_bytes", "link_bytes_per_s", "part_s")
    SENDER_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    VIEW_ID_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    SENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    LINK_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    PART_S_FIELD_NUMBER: _ClassVar[int]
    sender: str
    group_id: int
    round_id: int
    view_id: int
    commit: bool
    sent_bytes: int
    link_bytes_per_s: float
    part_s: float
    def __init__(self, sender: _Optional[str] = ..., group_id: _Optional[int] = ..., round_id: _Optional[int] = ..., view_id: _Optional[int] = ..., commit: _Optional[bool] = ..., sent_bytes: _Optional[int] = ..., link_bytes_per_s: _Optional[float] = ..., part_s: _Optional[float] = ...) -> None: ...

class VoteReply(_message.Message):
    __slots__ = ("status", "detail")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    status: StatusCode
    detail: str
    def __init__(self, status: _Optional[_Union[StatusCode, str]] = ..., detail: _Optional[str] = ...) -> None: ...

class StateManifestRequest(_message.Message):
    __slots__ = ("sender",)
    SENDER_FIELD_NUMBER: _ClassVar[int]
    sender: str
    def __init__(self, sender: _Optional[str] = ...) -> None: ...

class TensorEntry(_message.Message):
    __slots__ = ("name", "dtype", "shape", "nbytes", "sha256")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    nbytes: int
    sha256: bytes
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., nbytes: _Optional[int] = ..., sha256: _Optional[bytes] = ...) -> None: ...

class StateManifest(_message.Message):
    __slots__ = ("status", "detail", "snapshot_id", "step", "skeleton", "tensors", "manifest_hash")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SKELETON_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_HASH_FIELD_NUMBER: _ClassVar[int]
    status: StatusCode
    detail: str
    snapshot_id: int
    step: int
    skeleton: bytes
    tensors: _containers.RepeatedCompositeFieldContainer[TensorEntry]
    manifest_hash: bytes
    def __init__(self, status: _Optional[_Union[StatusCode, str]] = ..., detail: _Optional[str] = ..., snapshot_id: _Optional[int] = ..., step: _Optional[int] = ..., skeleton: _Optional[bytes] = ..., tensors: _Optional[_Iterable[_Union[TensorEntry, _Mapping]]] = ..., manifest_hash: _Optional[bytes] = ...) -> None: ...

class StateChunkRequest(_message.Message):
    __slots__ = ("sender", "snapshot_id", "tensor", "offset", "length")
    SENDER_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    sender: str
    snapshot_id: int
    tensor: str
    offset: int
    length: int
    def __init__(self, sender: _Optional[str] = ..., snapshot_id: _Optional[int] = ..., tensor: _Optional[str] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class StateChunk(_message.Message):
    __slots__ = ("offset", "data")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    offset: int
    data: bytes
    def __init__(self, offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...
