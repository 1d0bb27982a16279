"""The WAN path model (dreamp2p.devtools.wanmodel): delay, serialization, queue, loss, jitter, and the C twin.

Pure computations on synthetic packet traces; the last tests build ``wanemu.c`` with gcc and hold its
`--simulate` output equal to the Python model's, packet by packet.
"""

from __future__ import annotations

import itertools
import math
import random
import shutil
import statistics

import pytest

from dreamp2p.devtools.wanmodel import Fate, PathState, SplitMix64, WanPath, parse_loss, path_seed, simulate

pytestmark = pytest.mark.unit


def test_splitmix64_matches_the_reference_stream() -> None:
    # the first outputs for seed 0 of the reference implementation (Vigna's splitmix64.c)
    rng = SplitMix64(0)
    assert [rng.next_u64() for _ in range(3)] == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"rate_bps": 0}, "rate_bps"),
        ({"rate_bps": math.inf}, "rate_bps"),
        ({"rate_bps": 1e6, "delay_s": -1}, "delay_s"),
        ({"rate_bps": 1e6, "jitter_s": -0.1}, "jitter_s"),
        ({"rate_bps": 1e6, "loss": 1.0}, "loss"),
        ({"rate_bps": 1e6, "loss": -0.1}, "loss"),
        ({"rate_bps": 1e6, "loss_burst": 0.5}, "loss_burst"),
        ({"rate_bps": 1e6, "loss": 0.9, "loss_burst": 2.0}, "bursts"),
        ({"rate_bps": 1e6, "queue_bytes": -1}, "queue_bytes"),
        ({"rate_bps": 1e6, "seed": -1}, "seed"),
    ],
)
def test_bad_paths_are_refused_naming_the_field(kwargs: dict[str, float], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        WanPath(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "value"), [("0.1%", 0.001), ("0.001", 0.001), (0.05, 0.05), ("0", 0.0), (" 2.5% ", 0.025)]
)
def test_parse_loss(text: str | float, value: float) -> None:
    assert parse_loss(text) == pytest.approx(value)


@pytest.mark.parametrize("text", ["100%", "1.5", "-1%", "lots", "nan"])
def test_parse_loss_refuses(text: str) -> None:
    with pytest.raises(ValueError, match="loss"):
        parse_loss(text)


def test_parse_takes_the_units_people_write() -> None:
    p = WanPath.parse("100mbit", rtt="100ms", jitter="5ms", loss="0.1%")
    assert (p.rate_bps, p.delay_s, p.jitter_s, p.loss) == (pytest.approx(100e6), 0.05, 0.005, pytest.approx(0.001))
    # the default queue: 100 ms at the rate, never under 64 KiB
    assert p.queue_limit == 1_250_000
    assert WanPath.parse("1mbit").queue_limit == 64 << 10


@pytest.mark.parametrize(("rate", "delay", "size"), [(8e6, 0.0, 1000), (100e6, 0.05, 1500), (1e6, 0.2, 60)])
def test_a_lone_packet_leaves_after_its_serialization_and_the_delay(rate: float, delay: float, size: int) -> None:
    [(fate, dep)] = simulate(WanPath(rate_bps=rate, delay_s=delay), [(1.0, size)])
    assert fate is Fate.DELIVERED
    assert dep == pytest.approx(1.0 + size * 8 / rate + delay)


@pytest.mark.parametrize(("rate", "size", "count"), [(8e6, 1000, 50), (20e6, 1500, 200)])
def test_a_burst_is_serialized_back_to_back_at_the_rate(rate: float, size: int, count: int) -> None:
    out = simulate(WanPath(rate_bps=rate, delay_s=0.01, queue_bytes=size * count), [(0.0, size)] * count)
    deps = [d for _, d in out]
    gaps = [b - a for a, b in itertools.pairwise(deps)]
    assert all(g == pytest.approx(size * 8 / rate) for g in gaps)
    assert deps[-1] == pytest.approx(count * size * 8 / rate + 0.01)


@pytest.mark.parametrize(("queue", "size", "count"), [(10_000, 1000, 30), (64 << 10, 1500, 100), (3000, 1500, 5)])
def test_the_queue_tail_drops_what_does_not_fit(queue: int, size: int, count: int) -> None:
    out = simulate(WanPath(rate_bps=1e6, queue_bytes=queue), [(0.0, size)] * count)
    fates = [f for f, _ in out]
    fit = queue // size  # everything arrives at once: the queue holds this many, the rest is dropped
    assert fates == [Fate.DELIVERED] * fit + [Fate.QUEUE_DROP] * (count - fit)


def test_a_drained_queue_takes_packets_again() -> None:
    path = WanPath(rate_bps=8e6, queue_bytes=2000)  # 1000-byte packets take 1 ms each
    fates = [f for f, _ in simulate(path, [(0.0, 1000), (0.0, 1000), (0.0, 1000), (0.0021, 1000)])]
    assert fates == [Fate.DELIVERED, Fate.DELIVERED, Fate.QUEUE_DROP, Fate.DELIVERED]


def test_the_carried_rate_of_an_overdriven_path_is_its_rate() -> None:
    rate, size = 20e6, 1428
    gap = size * 8 / rate / 1.3  # 30% more than the path carries
    out = simulate(WanPath(rate_bps=rate), [(i * gap, size) for i in range(20000)])
    deps = [d for f, d in out if f is Fate.DELIVERED]
    assert any(f is Fate.QUEUE_DROP for f, _ in out)
    assert (len(deps) - 1) * size * 8 / (deps[-1] - deps[0]) == pytest.approx(rate, rel=1e-6)


@pytest.mark.parametrize("loss", [0.001, 0.01, 0.1])
@pytest.mark.parametrize("seed", [1, 2])
def test_independent_losses_stay_in_their_binomial_bounds(loss: float, seed: int) -> None:
    n = 100_000
    out = simulate(WanPath(rate_bps=1e9, loss=loss, seed=seed), [(i * 1e-3, 100) for i in range(n)])
    lost = sum(f is Fate.LOST for f, _ in out)
    half = 3.29 * math.sqrt(n * loss * (1 - loss))  # 99.9%
    assert abs(lost - n * loss) <= half + 1, lost


@pytest.mark.parametrize(("loss", "burst"), [(0.01, 3.0), (0.05, 8.0), (0.02, 1.5)])
def test_gilbert_losses_have_the_long_run_rate_and_mean_burst(loss: float, burst: float) -> None:
    n = 400_000
    out = simulate(WanPath(rate_bps=1e9, loss=loss, loss_burst=burst), [(i * 1e-4, 100) for i in range(n)])
    lost = [f is Fate.LOST for f, _ in out]
    bursts = sum(1 for i, x in enumerate(lost) if x and (i == 0 or not lost[i - 1]))
    assert sum(lost) / n == pytest.approx(loss, rel=0.15)
    assert sum(lost) / bursts == pytest.approx(burst, rel=0.1)


@pytest.mark.parametrize("jitter", [0.001, 0.01])
def test_jitter_is_normal_around_the_delay_when_reordering_is_allowed(jitter: float) -> None:
    path = WanPath(rate_bps=1e9, delay_s=0.1, jitter_s=jitter, reorder=True)
    arrivals = [(i * 1e-3, 100) for i in range(20000)]
    delays = [d - t - 800 / 1e9 for (t, _), (_, d) in zip(arrivals, simulate(path, arrivals), strict=True)]
    assert statistics.mean(delays) == pytest.approx(0.1, abs=jitter * 0.05)
    assert statistics.stdev(delays) == pytest.approx(jitter, rel=0.05)
    deps = [d for _, d in simulate(path, arrivals)]
    assert any(b < a for a, b in itertools.pairwise(deps))  # 1 ms apart, sd >= 1 ms: some pass


def test_without_reordering_packets_leave_in_order() -> None:
    path = WanPath(rate_bps=1e9, delay_s=0.1, jitter_s=0.01)
    deps = [d for _, d in simulate(path, [(i * 1e-3, 100) for i in range(5000)])]
    assert deps == sorted(deps)


def test_the_same_seed_gives_the_same_fates_and_another_seed_others() -> None:
    trace = [(i * 1e-4, 1500) for i in range(5000)]
    one = simulate(WanPath(rate_bps=1e8, jitter_s=0.002, loss=0.05, seed=3), trace)
    assert one == simulate(WanPath(rate_bps=1e8, jitter_s=0.002, loss=0.05, seed=3), trace)
    assert one != simulate(WanPath(rate_bps=1e8, jitter_s=0.002, loss=0.05, seed=4), trace)


def test_paths_get_distinct_seeds() -> None:
    seeds = {path_seed(1, i, j) for i in range(8) for j in range(8)}
    assert len(seeds) == 64
    state = PathState(WanPath(rate_bps=1e6), seed=path_seed(1, 0, 1))
    assert state.rng.state == 1 + 1


def _trace(seed: int, n: int) -> list[tuple[float, int]]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(3000.0)
        out.append((t, rng.choice([40, 52, 576, 1500])))
    return out


@pytest.mark.skipif(shutil.which("gcc") is None and shutil.which("cc") is None, reason="needs a C compiler")
@pytest.mark.parametrize(
    "path",
    [
        WanPath.parse("20mbit", rtt="100ms", loss="1%"),
        WanPath.parse("10mbit", rtt="40ms", jitter="5ms", loss="2%", loss_burst=4.0, seed=9),
        WanPath.parse("5mbit", rtt="200ms", jitter="20ms", reorder=True, queue_bytes=30000, seed=11),
    ],
)
def test_the_forwarders_c_model_gives_the_same_fates_and_departures(path: WanPath) -> None:
    from dreamp2p.devtools.wanemu import simulate_native

    trace = _trace(path.seed, 20000)
    python = simulate(path, trace)
    native = simulate_native(path, trace)
    assert len(native) == len(python)
    for i, ((f_py, d_py), (f_c, d_c)) in enumerate(zip(python, native, strict=True)):
        assert (f_c, d_c) == (int(f_py), pytest.approx(d_py, abs=1e-8)), i
    assert {f for f, _ in python} >= {Fate.DELIVERED}
