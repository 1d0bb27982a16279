"""`bench lm --slow`: parsing the regions' speeds and the throttle's arithmetic (`devtools.bench.lm.speeds`)."""

from __future__ import annotations

import pytest

from dreamp2p.devtools.bench.lm.speeds import parse_slow, throttle_s


@pytest.mark.parametrize(
    ("items", "regions", "speeds"),
    [
        ([], 2, (1.0, 1.0)),
        (["1=0.5"], 2, (1.0, 0.5)),
        (["0=0.25", "2=1"], 3, (0.25, 1.0, 1.0)),
        (["2=0.33"], 3, (1.0, 1.0, 0.33)),
    ],
)
def test_speeds_per_region(items: list[str], regions: int, speeds: tuple[float, ...]) -> None:
    assert parse_slow(items, regions) == speeds


@pytest.mark.parametrize(
    ("items", "match"),
    [
        (["1"], "expected REGION=FACTOR"),
        (["2=0.5"], r"region must be in 0\.\.1"),
        (["-1=0.5"], r"region must be in 0\.\.1"),
        (["x=0.5"], "expected REGION=FACTOR"),
        (["1=half"], "expected REGION=FACTOR"),
        (["1=0"], r"factor must be in \(0, 1\]"),
        (["1=1.5"], r"factor must be in \(0, 1\]"),
        (["1=nan"], r"factor must be in \(0, 1\]"),
        (["1=0.5", "1=0.25"], "region 1 is named twice"),
    ],
)
def test_bad_items_are_named(items: list[str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_slow(items, 2)


@pytest.mark.parametrize(
    ("busy", "speed", "idle"), [(0.1, 1.0, 0.0), (0.1, 0.5, 0.1), (0.2, 0.25, 0.6), (-0.1, 0.5, 0.0)]
)
def test_a_step_idles_so_the_region_runs_at_its_speed(busy: float, speed: float, idle: float) -> None:
    assert throttle_s(busy, speed) == pytest.approx(idle)
    if busy > 0:  # busy + idle = busy / speed: the step takes 1 / speed as long
        assert busy + throttle_s(busy, speed) == pytest.approx(busy / speed)


@pytest.mark.parametrize("speed", [0.0, -1.0, 1.5])
def test_speed_outside_0_1_is_refused(speed: float) -> None:
    with pytest.raises(ValueError, match="speed must be in"):
        throttle_s(0.1, speed)
