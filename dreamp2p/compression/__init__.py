"""Tensor wire codecs (lossless, quantized and sparse), the zstd lossless stage and sender-side error feedback."""

from dreamp2p.compression.base import (
    Codec,
    CodecError,
    NonFiniteError,
    UnknownCodecError,
    codec_names,
    get_codec,
    register_codec,
)
from dreamp2p.compression.codecs import BF16, E3M0, FP16, FP32, INT2, INT4, INT8
from dreamp2p.compression.feedback import ErrorFeedback
from dreamp2p.compression.lossless import ZstdStage
from dreamp2p.compression.sparse import TOPK

__all__ = [
    "BF16",
    "E3M0",
    "FP16",
    "FP32",
    "INT2",
    "INT4",
    "INT8",
    "TOPK",
    "Codec",
    "CodecError",
    "ErrorFeedback",
    "NonFiniteError",
    "UnknownCodecError",
    "ZstdStage",
    "codec_names",
    "get_codec",
    "register_codec",
]
