"""Wire codec names as configuration checks them: which exist, which are sparse, which send fewer bytes.

The codecs themselves live in :mod:`dreamp2p.compression`; configuration is a leaf that may not import it, so
the facts a config check needs are kept here, once, and a unit test (tests/unit/test_codec_names.py) holds them
equal to the codec registry: the names in wire-id order, the sparse flag, and the order of wire bytes per
fp32 byte (``Codec.wire_ratio``). A codec added to the registry fails that test until it is named here.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from dreamp2p.config.parse import did_you_mean

# Every registered codec, in wire-id order (as `dreamp2p.compression.codec_names()` lists them).
CODEC_NAMES: tuple[str, ...] = ("fp32", "fp16", "bf16", "int8", "int4", "e3m0", "topk", "int2")
# Codecs that send a few values of each block and decode the rest as zeros (usable only with error feedback).
SPARSE_CODECS: frozenset[str] = frozenset({"topk"})
# Codecs that lose so much of each round (about half of an update with int2, 98% with topk) that pseudo-gradient
# syncs use them only with error feedback, which carries the loss into the next rounds.
FEEDBACK_CODECS: frozenset[str] = frozenset({"int2", "topk"})
# What a node may name as its handshake default codec (`[node] codec`), the one parameters are averaged in:
# every codec but those that need error feedback (2 bits or 2% of a weight would wreck the model).
PARAMETER_CODECS: tuple[str, ...] = tuple(c for c in CODEC_NAMES if c not in FEEDBACK_CODECS)
# The codecs grouped by wire bytes per fp32 byte, most bytes first; codecs in one group send the same.
_BY_WIRE_BYTES: tuple[tuple[str, ...], ...] = (
    ("fp32",),
    ("fp16", "bf16"),
    ("int8",),
    ("int4", "e3m0"),
    ("int2",),
    ("topk",),
)
_RANK = {name: rank for rank, group in enumerate(_BY_WIRE_BYTES) for name in group}


def canonical_codec(name: str) -> str:
    """The codec's registered name (names are case-insensitive, as `compression.get_codec` reads them)."""
    key = name.strip().lower() if isinstance(name, str) else name
    if key not in _RANK:
        raise ValueError(unknown_codec_message(name))
    return key


def unknown_codec_message(name: object) -> str:
    """The words for a codec name no codec has: the name, the closest codec name, every codec name."""
    hint = did_you_mean(name.strip().lower(), CODEC_NAMES) if isinstance(name, str) else ""
    return f"unknown codec {name!r}{hint}; known codecs: {', '.join(CODEC_NAMES)}"


def is_sparse(name: str) -> bool:
    """Whether ``name`` is a sparse codec; an unknown name is not (the check that knows its field refuses it)."""
    return isinstance(name, str) and name.strip().lower() in SPARSE_CODECS


def needs_feedback(name: str) -> bool:
    """Whether pseudo-gradients may travel in ``name`` only with error feedback (`FEEDBACK_CODECS`)."""
    return isinstance(name, str) and name.strip().lower() in FEEDBACK_CODECS


def wire_rank(name: str) -> int:
    """0 for the codec that sends the most bytes per fp32 byte, larger for fewer; equal ranks send the same."""
    return _RANK[canonical_codec(name)]


def check_link_codecs(base: str, candidates: Sequence[str], tolerance: float) -> tuple[str, ...]:
    """The per-link candidates a link may use (``base`` and those after it), or a ValueError saying what is wrong.

    The rules of `dreamp2p.schedule.linkcodec.choose_link_codecs`, checked without the codec registry: a
    finite tolerance >= 0, known names that do not repeat, ``base`` among them, least to most lossy order.
    """
    if isinstance(tolerance, bool) or not isinstance(tolerance, int | float) or not 0 <= tolerance < math.inf:
        raise ValueError(f"tolerance must be finite and >= 0, got {tolerance!r}")
    names = [canonical_codec(c) for c in candidates]
    base_name = canonical_codec(base)
    if len(set(names)) != len(names):
        raise ValueError(f"candidate codecs repeat: {list(candidates)}")
    if base_name not in names:
        raise ValueError(f"base codec {base_name} is not among the candidates {names}")
    for a, b in itertools.pairwise(names):
        if _RANK[b] < _RANK[a]:
            raise ValueError(f"candidates must be ordered least to most lossy: {b} sends more bytes than {a}")
    return tuple(names[names.index(base_name) :])
