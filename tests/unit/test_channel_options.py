"""The channel options factory: how fast a link that was down is tried again."""

from __future__ import annotations

import pytest

from dreamp2p.config import TransportConfig
from dreamp2p.transport.options import channel_options, max_reconnect_backoff_ms


@pytest.mark.parametrize(
    ("heartbeat_s", "expected_ms"),
    [(1.0, 1000), (0.5, 500), (0.1, 500), (2.5, 2500), (30.0, 5000), (0.0, 5000)],
)
def test_reconnect_backoff_is_bounded_by_one_heartbeat(heartbeat_s: float, expected_ms: int) -> None:
    cfg = TransportConfig(heartbeat_s=heartbeat_s)
    assert max_reconnect_backoff_ms(cfg) == expected_ms
    opts = dict(channel_options(cfg))
    assert opts["grpc.max_reconnect_backoff_ms"] == expected_ms
    assert opts["grpc.max_reconnect_backoff_ms"] >= opts["grpc.min_reconnect_backoff_ms"]
