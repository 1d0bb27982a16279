"""The codec names configuration checks (dreamp2p.config.codecs, a leaf) are the codec registry's, fact for fact.

Configuration may not import dreamp2p.compression (tests/unit/test_layering.py), so the names, the sparse flag
and the order of wire bytes live in config/codecs.py; these tests fail as soon as the registry and that list
part (a codec added, renamed, made sparse, or made to send more or fewer bytes than its neighbours).
"""

from __future__ import annotations

import itertools

import pytest

from dreamp2p.compression import codec_names, get_codec
from dreamp2p.config.codecs import (
    CODEC_NAMES,
    FEEDBACK_CODECS,
    PARAMETER_CODECS,
    SPARSE_CODECS,
    canonical_codec,
    check_link_codecs,
    is_sparse,
    wire_rank,
)
from dreamp2p.schedule.linkcodec import choose_link_codecs


def test_the_names_are_the_registry_s_in_wire_id_order() -> None:
    assert tuple(codec_names()) == CODEC_NAMES


def test_the_sparse_codecs_are_those_the_registry_marks_sparse() -> None:
    assert {n for n in codec_names() if get_codec(n).sparse} == SPARSE_CODECS
    assert all(is_sparse(n) == get_codec(n).sparse for n in codec_names())
    assert SPARSE_CODECS <= FEEDBACK_CODECS
    assert set(PARAMETER_CODECS) | FEEDBACK_CODECS == set(CODEC_NAMES) and not set(PARAMETER_CODECS) & FEEDBACK_CODECS


@pytest.mark.parametrize(("a", "b"), list(itertools.combinations(CODEC_NAMES, 2)))
def test_wire_rank_orders_codecs_as_their_wire_ratio_does(a: str, b: str) -> None:
    ra, rb = get_codec(a).wire_ratio(), get_codec(b).wire_ratio()
    assert (wire_rank(a) < wire_rank(b)) == (ra > rb)
    assert (wire_rank(a) == wire_rank(b)) == (ra == rb)


@pytest.mark.parametrize(
    ("base", "candidates", "tolerance"),
    [
        ("fp32", ["fp32", "bf16", "int8"], 0.25),
        ("bf16", ["fp32", "bf16", "int8", "int4"], 0.0),
        ("FP32", ["fp32", "Int8"], 1.0),
        ("fp32", ["bf16", "int8"], 0.25),
        ("fp32", ["fp32", "int8", "bf16"], 0.25),
        ("fp32", ["fp32", "fp32"], 0.25),
        ("fp32", ["fp32", "int8"], -1.0),
        ("fp32", ["fp32", "int4", "e3m0"], 0.25),
        ("fp32", ["fp32", "e3m0", "int4"], 0.25),
    ],
)
def test_link_codec_checks_agree_with_the_planner_s(base: str, candidates: list[str], tolerance: float) -> None:
    """Without the registry, the config check accepts and refuses what choose_link_codecs does, with its words."""
    try:
        expected: tuple[str, ...] | str = choose_link_codecs(base, candidates, [1.0], tolerance)[:0]
    except ValueError as exc:
        expected = str(exc)
    try:
        got: tuple[str, ...] | str = check_link_codecs(base, candidates, tolerance)[:0]
    except ValueError as exc:
        got = str(exc)
    assert got == expected


def test_an_unknown_codec_is_named() -> None:
    with pytest.raises(ValueError, match="unknown codec 'zip'; known codecs: fp32, fp16"):
        canonical_codec("zip")
    assert not is_sparse("zip")
