"""`bench regions`' pure parts: the quiet stretch per strategy, a phase's summary, tbf's bucket, the CLI check."""

from __future__ import annotations

from typing import Any

import pytest

from dreamp2p.cli import main
from dreamp2p.devtools.bench.regions.net import lan_host, wan_host
from dreamp2p.devtools.bench.regions.run import quiet_default, summarize_phase
from dreamp2p.devtools.netns import tbf_burst


@pytest.mark.parametrize(
    ("strategy", "sync", "quiet"),
    [
        ("ssgd", {}, 2),
        ("dreamddp", {"period": 4, "max_delay": 1}, 6),
        ("dreamddp", {"period": 10}, 20),  # max_delay None: up to period - 1
        ("localsgd", {"period": 5}, 10),
    ],
)
def test_quiet_stretch_covers_a_period_and_its_delay(strategy: str, sync: dict[str, Any], quiet: int) -> None:
    assert quiet_default(strategy, sync) == quiet


@pytest.mark.parametrize(("bps", "burst"), [(20e6, 32768), (1e9, 500_000), (100e6, 50_000)])
def test_tbf_bucket_is_four_ms_never_under_32k(bps: float, burst: int) -> None:
    assert tbf_burst(bps) == burst


def test_addresses_are_per_region_on_the_wan_and_per_rank_on_the_lan() -> None:
    assert [wan_host(r) for r in range(3)] == ["10.77.0.1", "10.77.0.2", "10.77.0.3"]
    assert [lan_host(1, k) for k in range(2)] == ["10.78.1.1", "10.78.1.2"]


def _rank(region: int, rank: int, loop_s: float, payload: int, digest: str = "d") -> dict[str, Any]:
    node = f"r{region}" if rank == 0 else f"r{region}.{rank}"
    return {
        "node_id": node,
        "region": region,
        "rank": rank,
        "timed_steps": 10,
        "loop_s": loop_s,
        "payload_bytes": payload,
        "wire_bytes": payload + 1000,
        "bytes_sent": payload + 5,
        "losses": [5.0, 4.0],
        "rounds_skipped": 0,
        "digest": digest,
    }


def test_a_region_is_as_fast_as_its_slowest_rank_and_sends_what_its_ranks_send() -> None:
    results = [_rank(0, 0, 4.0, 2_000_000), _rank(0, 1, 5.0, 2_000_000), _rank(1, 0, 5.0, 3_000_000)]
    results.append(_rank(1, 1, 5.0, 3_000_000))
    out = summarize_phase(results, regions=2, ranks=2, rate_Bps=1e6)
    assert out["per_region"][0] == {"steps_per_s": 2.0, "goodput_MBps": 0.8, "wire_goodput_MBps": 0.8004, "loop_s": 5.0}
    assert out["per_region"][1]["goodput_MBps"] == 1.2
    assert out["goodput_MBps"] == 1.0 and out["steps_per_s"] == 2.0
    assert out["bytes_per_rank"] == {"r0": 2_000_000, "r0.1": 2_000_000, "r1": 3_000_000, "r1.1": 3_000_000}
    assert out["link_util"] == round((2_001_000 / 4 + 2_001_000 / 5 + 2 * 3_001_000 / 5) / 4 / 1e6, 3)
    assert out["identical"] is True and out["loss_first"] == 5.0 and out["loss_last"] == 4.0


def test_one_rank_with_other_parameters_breaks_the_identity() -> None:
    results = [_rank(0, 0, 1.0, 10), _rank(1, 0, 1.0, 10, digest="other")]
    assert summarize_phase(results, regions=2, ranks=1, rate_Bps=1e6)["identical"] is False


def test_cli_runs_one_strategy_per_regions_bench(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", "regions", "--strategies", "ssgd", "dreamddp"])
    assert exc.value.code == 2
    assert "regions runs one strategy" in capsys.readouterr().err
