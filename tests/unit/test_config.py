"""Configuration parsing: TOML loading, unit parsing, and errors that name the offending key."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dreamp2p.config import PeerConfig, TransportConfig, parse_duration, parse_rate
from dreamp2p.config.sync import SyncConfig, dreamddp_settings


@pytest.mark.parametrize(
    ("text", "bytes_per_s"),
    [
        ("100mbit", 12.5e6),
        ("1gbit", 125e6),
        ("20Mbps", 2.5e6),
        ("20mbps", 2.5e6),  # bits, as networking writes it (tc would read megabytes)
        ("500kbit", 62.5e3),
        (8e6, 1e6),
        ("64bit", 8.0),
        ("100 Mbit/s", 12.5e6),
        ("1.5Gbit/s", 187.5e6),
        ("20Mb/s", 2.5e6),
        ("20MBps", 20e6),  # capital B: bytes, not 8x less
        ("2.5MB/s", 2.5e6),
        ("10 kbyte/s", 1e4),
        ("1e3kbit", 125e3),
        ("20mbit", 2.5e6),
        ("20Mbit/s", 2.5e6),
        ("100kbit", 12.5e3),
        ("1Gbit/s", 125e6),
    ],
)
def test_parse_rate(text: str | float, bytes_per_s: float) -> None:
    assert parse_rate(text) == pytest.approx(bytes_per_s)


@pytest.mark.parametrize(
    "text", ["fast", "-3mbit", "0mbit", "mbit", 0, -1, "20mb", "20MB", "20", "20 mbit per s", "1e999gbit", "nanmbit"]
)
def test_parse_rate_rejects(text: str | float) -> None:
    with pytest.raises(ValueError):
        parse_rate(text)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("80ms", 0.08),
        ("1.5s", 1.5),
        ("200us", 2e-4),
        (3, 3.0),
        ("30s", 30.0),
        ("5m", 300.0),  # minutes; "ms" is milliseconds
        ("5min", 300.0),
        ("1h", 3600.0),
        ("0.5h", 1800.0),
        (" 2 ms ", 2e-3),
        ("1E3ms", 1.0),
        ("0s", 0.0),
    ],
)
def test_parse_duration(text: str | float, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["soon", "-1s", -2, "5", "1d", "m", "5 minutes", "1e999h", "nanms", "1.2.3s"])
def test_parse_duration_rejects(text: str | float) -> None:
    with pytest.raises(ValueError):
        parse_duration(text)


def test_from_toml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DP2P_TEST_TOKEN", "abc")
    path = tmp_path / "node.toml"
    path.write_text(
        """
node_id = "eu-west"
cluster_id = "demo"
listen = "0.0.0.0:7070"
codec = "int8"
token_env = "DP2P_TEST_TOKEN"
allow_insecure = true
ring = [
  { node_id = "eu-west", address = "eu.example.org:7070" },
  { node_id = "us-east", address = "us.example.org:7070" },
]
[transport]
rate_limit = "20mbit"
round_timeout_s = "90s"
streams_per_link = 4
"""
    )
    cfg = PeerConfig.from_toml(path)
    assert cfg.token == "abc"
    assert cfg.allow_insecure and cfg.tls is None
    assert cfg.transport.rate_limit == pytest.approx(2.5e6)
    assert cfg.transport.round_timeout_s == 90.0
    assert [p.node_id for p in cfg.ring] == ["eu-west", "us-east"]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"node_id": "a", "colour": 1}, "unknown key colour"),
        ({"node_id": "a", "transport": {"streams": 2}}, "unknown key transport.streams"),
        (
            {"node_id": "a", "transport": {"streams_per_link": "two"}},
            "transport.streams_per_link must be an integer",
        ),
        ({"node_id": "a", "transport": {"streams_per_link": 0}}, "transport.streams_per_link must be > 0"),
        ({"node_id": "a", "codec": "int3"}, "codec must be one of"),
        ({"node_id": ""}, "node_id"),
        ({"node_id": "a", "ring": [{"node_id": "b", "address": "x:1"}]}, "does not contain this node"),
        ({"node_id": "a", "ring": "b"}, "ring must be a list"),
        ({"node_id": "a", "token_env": "DP2P_SURELY_UNSET"}, "DP2P_SURELY_UNSET"),
        ({"node_id": "a", "tls": {"cert_file": "c", "key_file": "k", "mutual": True}}, "ca_file"),
        ({"node_id": "a", "transport": {"rate_limit": "fast"}}, "cannot parse link rate"),
        ({"cluster_id": "x"}, "node_id"),
    ],
)
def test_bad_config_names_the_key(data: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PeerConfig.from_dict(data)


def test_transport_limits() -> None:
    with pytest.raises(ValueError, match="chunk_min_bytes"):
        TransportConfig(chunk_min_bytes=10 << 20, chunk_max_bytes=1 << 20)
    with pytest.raises(ValueError, match="headroom"):
        TransportConfig(max_message_bytes=4 << 20, chunk_max_bytes=4 << 20)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"link_codecs": ["bf16", "int8"]}, "sync.link_codecs: base codec fp32 is not among the candidates"),
        ({"link_codecs": ["fp32", "int8", "bf16"]}, "must be ordered least to most lossy"),
        ({"link_codecs": ["fp32", "zip"]}, "sync.link_codecs"),
        ({"link_codecs": "fp32,int8"}, "must be a list of codec names"),
        ({"link_codecs": ["fp32", "int8"], "link_codec_tolerance": -1}, "tolerance must be finite and >= 0"),
    ],
)
def test_bad_link_codecs_are_refused(data: dict[str, object], message: str) -> None:
    from dreamp2p.config.sync import SyncConfig

    with pytest.raises(ValueError, match=message):
        SyncConfig.from_dict(data)


def test_link_codecs_from_a_toml_array_become_a_tuple() -> None:
    from dreamp2p.config.sync import SyncConfig

    cfg = SyncConfig.from_dict({"link_codecs": ["fp32", "bf16", "int8"]})
    assert cfg.link_codecs == ("fp32", "bf16", "int8")


@pytest.mark.parametrize(
    ("codec", "period", "delay", "expected"),
    [
        ("int4", 20, 4, {"delta_codec": "int4"}),
        ("E3M0", 10, 9, {"delta_codec": "e3m0"}),
        ("topk", 10, 2, {"delta_codec": "topk"}),  # its unsent parts stay in the parameters (keep_unsent)
        ("int8", 20, 19, {"delta_codec": "", "plan_codecs": ["int8"]}),
        ("fp32", 50, 0, {"delta_codec": "", "plan_codecs": ["fp32"]}),
        ("bf16", 1, 0, {"delta_codec": "", "plan_codecs": ["bf16"], "stream_delay": 0}),
        ("int4", 20, None, {"delta_codec": "int4"}),  # no cap given: the default, period - 1
    ],
)
def test_dreamddp_settings_say_which_field_carries_the_codec(
    codec: str, period: int, delay: int | None, expected: dict[str, object]
) -> None:
    settings = dreamddp_settings(codec, period, delay)
    capped = {} if delay is None else {"max_delay": delay}
    assert settings == {"strategy": "dreamddp", "period": period, **capped, **expected}
    cfg = SyncConfig.from_dict(settings)  # what a node would load from them
    assert (cfg.period, cfg.delay_cap) == (period, period - 1 if delay is None else delay)
    assert cfg.delta_codec == expected["delta_codec"]


@pytest.mark.parametrize(
    ("codec", "period", "delay", "message"),
    [
        ("int4", 5, 5, "sync.max_delay (5) must be < sync.period (5)"),
        ("int4", 0, 0, "sync.period must be >= 1"),
        ("zstd9", 20, 4, "unknown codec 'zstd9'"),
    ],
)
def test_dreamddp_settings_refuse_what_a_run_would(codec: str, period: int, delay: int, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        dreamddp_settings(codec, period, delay)
