"""`dreamp2p config check`'s walk: every error of a daemon's file at once, each in the loaders' words."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dreamp2p.config import DaemonConfig
from dreamp2p.config.check import check_daemon_config, check_file
from dreamp2p.config.parse import did_you_mean

ROOT = Path(__file__).resolve().parents[2]
GOOD: dict[str, Any] = {"node": {"node_id": "eu-west"}, "sync": {"period": 8, "max_delay": 3}}


def test_a_clean_config_has_no_error() -> None:
    assert check_daemon_config(GOOD) == []
    DaemonConfig.from_dict(GOOD)  # and the loader agrees


def test_every_error_is_reported_at_once() -> None:
    data = {
        "node": {"node_id": "eu-west", "colr": 1, "transport": {"stream_per_link": 2, "rate_limit": "warp"}},
        "sync": {"stratgy": "dreamddp", "period": 0, "round_timeout_s": 3},
        "task": {"steps": 0, "dim": 65},
        "checkpoint": {"keep": 0},
        "metrics": {"log_format": "xml", "jsonl_files": 0},
        "devise": "cpu",
        "threads": -1,
    }
    errors = check_daemon_config(data)
    expected = [
        "unknown table or key 'devise' (did you mean 'device'?)",
        "unknown key node.transport.stream_per_link (did you mean 'streams_per_link'?)",
        "node.transport.rate_limit: cannot parse link rate 'warp'",
        "unknown key node.colr",
        "sync.round_timeout_s is no longer a setting",
        "unknown key sync.stratgy (did you mean 'strategy'?)",
        "sync.period must be >= 1",
        "task.steps must be >= 1",
        "task.dim (65) must be a multiple of task.heads (4)",
        "checkpoint.every_steps and checkpoint.keep must be >= 1",
        "metrics.log_format must be one of text, json",
        "metrics.jsonl_files must be >= 1",
        "threads must be an integer >= 0",
    ]
    assert len(errors) == len(expected), errors
    for message, error in zip(expected, errors, strict=True):
        assert message in error, (message, error)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"sync": {"period": 4, "max_delay": 4}}, "sync.max_delay (4) must be < sync.period (4)"),
        ({"node": {"node_id": "a", "listen": "0.0.0.0:7070"}}, "TLS is required outside loopback"),
        ({"node": {"cluster_id": "x"}}, "node: missing key node_id"),
        ({"node": {"node_id": "a", "token_env": "DP2P_SURELY_UNSET_VAR"}}, "DP2P_SURELY_UNSET_VAR"),
        ({"node": {"node_id": "a", "ring": [{"node_id": "b"}]}}, "node.ring[0]: missing key address"),
        ({"node": {"node_id": "a", "tls": {"cert_file": "c", "key_file": "k", "mutual": True}}}, "ca_file"),
        ({"node": {"node_id": "a"}, "metrics": {"progress_every_s": "soon"}}, "metrics.progress_every_s: cannot parse"),
        (
            {"checkpoint": {"on_write_error": "ignore"}},
            "checkpoint.on_write_error must be one of continue, stop; got 'ignore'",
        ),
        (
            {"checkpoint": {"on_write_eror": "stop"}},
            "unknown key checkpoint.on_write_eror (did you mean 'on_write_error'?)",
        ),
        ({}, "missing [node] table"),
    ],
)
def test_one_error_in_the_loaders_words(data: dict[str, Any], message: str) -> None:
    full = {"node": GOOD["node"], **data}
    if data == {}:
        full = {}
    errors = check_daemon_config(full)
    assert len(errors) == 1 and message in errors[0], errors
    with pytest.raises(ValueError):  # the loader refuses the same file
        DaemonConfig.from_dict(full)


def test_checkpoint_write_errors_continue_unless_the_file_says_stop() -> None:
    assert DaemonConfig.from_dict(GOOD).checkpoint.on_write_error == "continue"
    stop = {**GOOD, "checkpoint": {"on_write_error": "stop"}}
    assert check_daemon_config(stop) == []
    assert DaemonConfig.from_dict(stop).checkpoint.on_write_error == "stop"


KNOWN_CODECS = "known codecs: fp32, fp16, bf16, int8, int4, e3m0, topk, int2"


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            {"sync": {"strategy": "dilocco"}},
            "sync.strategy must be one of none, ssgd, localsgd, diloco, streaming, co2, dreamddp; "
            "got 'dilocco' (did you mean 'diloco'?)",
        ),
        ({"sync": {"buffers": "averge"}}, "sync.buffers must be one of average, broadcast; got 'averge' (did you mean"),
        ({"sync": {"codec": "in8"}}, f"sync.codec: unknown codec 'in8' (did you mean 'int8'?); {KNOWN_CODECS}"),
        ({"sync": {"stream_codec": "e3mo"}}, "sync.stream_codec: unknown codec 'e3mo' (did you mean 'e3m0'?)"),
        ({"sync": {"delta_codec": "int44"}}, "sync.delta_codec: unknown codec 'int44' (did you mean 'int4'?)"),
        ({"sync": {"plan_codecs": ["inr8"]}}, "sync.plan_codecs: unknown codec 'inr8' (did you mean 'int8'?)"),
        ({"sync": {"link_codecs": ["fp32", "bf61"]}}, "sync.link_codecs: unknown codec 'bf61' (did you mean 'bf16'?)"),
        ({"node": {"node_id": "a", "codec": "fp61"}}, "node.codec must be one of fp32, fp16, bf16, int8, int4, e3m0; "),
        ({"node": {"node_id": "a", "comm": "threads"}}, "node.comm must be one of thread, process; got 'threads' (did"),
        ({"train": {"amp": "bf61"}}, "train.amp must be one of off, bf16, fp16; got 'bf61' (did you mean 'bf16'?)"),
        ({"train": {"schedule": "cosin"}}, "train.schedule must be one of constant, cosine; got 'cosin' (did you"),
    ],
)
def test_an_enumerated_setting_names_its_full_key_and_the_closest_choice(data: dict[str, Any], message: str) -> None:
    errors = check_daemon_config({"node": GOOD["node"], **data})
    assert len(errors) == 1 and message in errors[0], errors
    with pytest.raises(ValueError):  # the loader refuses the same file
        DaemonConfig.from_dict({"node": GOOD["node"], **data})


def test_no_suggestion_when_nothing_is_close() -> None:
    (error,) = check_daemon_config({"node": GOOD["node"], "sync": {"strategy": "gossip"}})
    assert error.endswith("got 'gossip'"), error


def test_an_error_caused_by_another_keys_default_is_not_reported() -> None:
    # period 0 is wrong; with it taken out, max_delay 15 would be checked against the default period 10
    errors = check_daemon_config({"node": GOOD["node"], "sync": {"period": 0, "max_delay": 15}})
    assert errors == ["sync.period must be >= 1, got 0"], errors


@pytest.mark.parametrize(
    ("key", "allowed", "hint"),
    [
        ("stratgy", ["strategy", "period"], " (did you mean 'strategy'?)"),
        ("perod", ["strategy", "period"], " (did you mean 'period'?)"),
        ("colour", ["strategy", "period"], ""),
    ],
)
def test_did_you_mean(key: str, allowed: list[str], hint: str) -> None:
    assert did_you_mean(key, allowed) == hint


def test_check_file_reads_toml_and_names_syntax_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[node]\nnode_id = 'a'\nperiod = = 3\n")
    (error,) = check_file(bad)
    assert error.startswith("not valid TOML")
    assert check_file(tmp_path / "missing.toml")[0].startswith("cannot read")
    good = tmp_path / "good.toml"
    good.write_text("[node]\nnode_id = 'a'\n[sync]\nperiod = 8\n")
    assert check_file(good) == []


@pytest.mark.parametrize("name", ["eu-west", "us-east", "ap-south"])
def test_the_shipped_node_files_pass(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DREAMP2P_TOKEN", "t")
    assert check_file(ROOT / "nodes" / f"{name}.toml") == []
