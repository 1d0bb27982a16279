"""`bench lm` strategy variants: NAME:key=value,... parsed into a strategy and its own overrides."""

from __future__ import annotations

from typing import Any

import pytest

from dreamp2p.config.sync import SyncConfig
from dreamp2p.devtools.bench.lm.run import parse_variant


@pytest.mark.parametrize(
    ("entry", "expected"),
    [
        ("dreamddp", ("dreamddp", {})),
        ("dreamddp:", ("dreamddp", {})),
        ("dreamddp:error_feedback=true", ("dreamddp", {"error_feedback": True})),
        ("streaming:fragments=2, stream_codec=int8", ("streaming", {"fragments": 2, "stream_codec": "int8"})),
        ('dreamddp:plan_margin=0.5,delta_codec="e3m0"', ("dreamddp", {"plan_margin": 0.5, "delta_codec": "e3m0"})),
        (
            "dreamddp:delta_codec=topk,error_feedback=true",
            ("dreamddp", {"delta_codec": "topk", "error_feedback": True}),
        ),
        (  # the commas of a list belong to its value
            'dreamddp:delta_fallbacks=["int2","topk"],keep_unsent=true',
            ("dreamddp", {"delta_fallbacks": ["int2", "topk"], "keep_unsent": True}),
        ),
        ("dreamddp:delta_fallbacks=[],period=5", ("dreamddp", {"delta_fallbacks": [], "period": 5})),
    ],
)
def test_variants_parse_into_overrides(entry: str, expected: tuple[str, dict[str, Any]]) -> None:
    assert parse_variant(entry) == expected


@pytest.mark.parametrize("entry", ["dreamddp:error_feedback", "dreamddp:=1", "dreamddp:a=1,b"])
def test_a_setting_without_a_value_is_refused(entry: str) -> None:
    with pytest.raises(ValueError, match="expected key=value"):
        parse_variant(entry)


def test_the_sparse_variant_is_a_valid_dreamddp_config_and_needs_error_feedback() -> None:
    """What bench lm checks before it starts anything: the variant's overrides over the strategy and period."""
    strategy, own = parse_variant("dreamddp:delta_codec=topk,error_feedback=true")
    cfg = SyncConfig.from_dict({"strategy": strategy, "period": 20, **own})
    assert (cfg.delta_codec, cfg.error_feedback) == ("topk", True)
    strategy, own = parse_variant("dreamddp:delta_codec=topk,keep_unsent=false")
    with pytest.raises(ValueError, match=r"needs sync\.error_feedback = true"):
        SyncConfig.from_dict({"strategy": strategy, "period": 20, **own})
