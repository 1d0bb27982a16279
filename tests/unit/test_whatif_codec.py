"""`dreamp2p plan` prices DreamDDP's syncs in the codec a run's planner would give its pseudo-gradients on the
link (`schedule.whatif.run_delta_codec`): the first of the chain the link carries, else the last."""

from __future__ import annotations

import pytest

from dreamp2p.compression import get_codec
from dreamp2p.schedule.whatif import run_delta_codec

CHAIN = [(c, get_codec(c).wire_ratio()) for c in ("int4", "int2")]
# bench lm's byte-level GPT: 3.32M parameters in 4 blocks, 0.28 s per step, 2 regions, period 20
GPT = {"params": 3.32e6, "layers": 4, "step_time_s": 0.28, "peers": 2, "rtt_s": 0.0, "period": 20, "max_delay": 19}


@pytest.mark.parametrize(
    ("rate_Bps", "codec"),
    [(125e6, "int4"), (2.5e6, "int4"), (0.25e6, "int2"), (0.125e6, "int2")],
    ids=["1gbit", "20mbit", "2mbit", "1mbit"],
)
def test_the_link_picks_the_codec(rate_Bps: float, codec: str) -> None:
    assert run_delta_codec(CHAIN, bandwidth_Bps=rate_Bps, **GPT) == codec  # type: ignore[arg-type]


def test_a_chain_of_one_is_that_codec_and_an_empty_one_is_refused() -> None:
    assert run_delta_codec(CHAIN[:1], bandwidth_Bps=1e3, **GPT) == "int4"  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no candidate codecs"):
        run_delta_codec([], bandwidth_Bps=1e6, **GPT)  # type: ignore[arg-type]
