"""`dreamp2p bench`'s parser (issue 35): one sub-parser per bench with only its own options, parsed without
running anything. ``--help`` of a bench lists its options alone, another bench's option is refused by name,
each bench's defaults land in the namespace, and the commands the docs give still parse."""

from __future__ import annotations

import argparse
import re
import shlex

import pytest

from dreamp2p.cli import build_parser
from dreamp2p.devtools.benchargs import BENCHES

COMMON = {"-h", "--help", "--json", "-v", "-vv", "--verbose"}  # -vv: in -v's help
# every bench's own options, besides COMMON (hidden aliases of older names not included)
OPTIONS: dict[str, set[str]] = {
    "codec": {"--mbytes", "--repeats", "--codecs"},
    "transport": {"--mbytes", "--seconds", "--streams", "--netns", "--rate", "--rtt", "--jitter", "--loss"},
    "probe": {"--rates", "--rtts", "--losses", "--bursts", "--syncs", "--sync-kb"},
    "allreduce": {"--peers", "--mbytes", "--codecs", "--repeats", "--streams", "--netns", "--rate"},
    "soak": {"--minutes", "--peers", "--mbytes"},
    "strategies": {
        *("--strategies", "--steps", "--period", "--width", "--depth", "--batch", "--rate", "--rtt"),
        *("--max-delay", "--codec", "--lr", "--device"),
    },
    "lm": {
        *("--strategies", "--regions", "--rate", "--rtt", "--steps", "--period", "--width", "--depth"),
        *("--max-delay", "--device", "--bracket", "--rounds", "--loss", "--jitter", "--slow"),
    },
    "plancheck": {"--steps", "--period", "--sizes", "--rates", "--rtts", "--region-counts", "--target-cu", "--out"}
    | {"--reports"},
    "digits": {"--strategies", "--peers", "--max-delay"},
    "memory": {"--strategies", "--params", "--period", "--device", "--ranks"},
    "chaos": {
        *("--minutes", "--peers", "--kill-every", "--down", "--max-down", "--flap-every", "--flap-down", "--no-flaps"),
        *("--rate", "--rtt", "--period", "--width", "--depth", "--max-delay", "--seed", "--run-dir"),
        *("--kinds", "--stop-min", "--stop-max", "--long-stop-p", "--long-stop-max", "--partition-min"),
        *("--partition-max", "--oneway-p", "--min-step", "--loss", "--jitter"),
    },
    "regions": {
        *("--regions", "--ranks", "--rate", "--rtt", "--strategies", "--steps", "--period", "--width", "--depth"),
        "--max-delay",
        "--fsdp",
        "--hosts",
    },
}


def parse(argv: list[str]) -> argparse.Namespace:
    """The namespace `main` would run, its checks across options done (a usage error raises SystemExit)."""
    args = build_parser().parse_args(argv)
    if args.check is not None:
        args.check(args)
    return args


def usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as info:
        parse(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


def help_text(bench: str, capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["bench", bench, "--help"])
    assert info.value.code == 0
    return capsys.readouterr().out


def test_every_bench_has_its_expected_options() -> None:
    assert set(BENCHES) == set(OPTIONS)


def test_bench_lm_help_lists_only_lm_options(capsys: pytest.CaptureFixture[str]) -> None:
    text = help_text("lm", capsys)
    assert "--bracket" in text and "--rounds" in text and "--rate" in text
    for foreign in ("--mbytes", "--kill-every", "--codecs", "--link-rate", "--seconds", "--sizes", "--batch"):
        assert foreign not in text, foreign


@pytest.mark.parametrize("bench", sorted(OPTIONS))
def test_each_bench_help_shows_exactly_its_own_options(bench: str, capsys: pytest.CaptureFixture[str]) -> None:
    shown = set(re.findall(r"(?<![\w-])--?[a-z][a-z-]*", help_text(bench, capsys)))
    assert shown - COMMON == OPTIONS[bench]


def test_an_option_of_other_benches_is_refused_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    line = usage_error(["bench", "lm", "--mbytes", "3"], capsys)
    assert line.startswith("dreamp2p bench lm: error: argument --mbytes: not an option of bench lm")
    assert "bench codec, transport, allreduce, soak take it" in line
    line = usage_error(["bench", "codec", "--kill-every", "5"], capsys)
    assert "argument --kill-every: not an option of bench codec; bench chaos takes it" in line
    line = usage_error(["bench", "digits", "--netns"], capsys)  # a flag without a value too
    assert "argument --netns: not an option of bench digits" in line


def test_an_option_no_bench_takes_is_still_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert "unrecognized arguments: --colour" in usage_error(["bench", "lm", "--colour"], capsys)


def test_one_name_for_the_link_rate() -> None:
    assert parse(["bench", "strategies", "--rate", "5mbit"]).rate == "5mbit"
    assert parse(["bench", "strategies", "--link-rate", "5mbit"]).rate == "5mbit"  # the old name, hidden
    for bench in ("transport", "allreduce", "strategies", "lm", "chaos", "regions"):
        assert not hasattr(parse(["bench", bench]), "link_rate")


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["bench", "lm"], {"steps": 200, "period": 20, "width": 256, "depth": 4, "rate": "20mbit", "rtt": "0ms"}),
        (["bench", "strategies"], {"steps": 150, "period": 10, "width": 512, "rate": None, "rtt": "20ms"}),
        (["bench", "chaos"], {"peers": 5, "rate": "50mbit", "rtt": "4ms", "period": 5, "width": 64, "depth": 2}),
        (
            ["bench", "chaos"],
            {"kinds": None, "stop_min": 2.0, "stop_max": 20.0, "long_stop_p": 0.1, "long_stop_max": 180.0},
        ),
        (["bench", "chaos"], {"partition_min": 5.0, "partition_max": 30.0, "oneway_p": 0.5}),
        (["bench", "chaos", "--kinds", "Kill, stop"], {"kinds": ("kill", "stop")}),
        (["bench", "chaos"], {"loss": 0.0, "jitter": "0ms"}),
        (["bench", "chaos", "--rtt", "80ms", "--loss", "0.1%"], {"rtt": "80ms", "loss": pytest.approx(0.001)}),
        (["bench", "regions"], {"steps": 12, "regions": 2, "ranks": 2, "rate": "20mbit", "strategies": None}),
        (["bench", "plancheck"], {"steps": 100, "period": 20, "region_counts": [2, 3]}),
        (["bench", "codec"], {"mbytes": 64.0, "repeats": 3, "codecs": None}),
        (["bench", "soak"], {"mbytes": 4.0, "peers": 4, "minutes": 10.0}),
        (["bench", "allreduce"], {"mbytes": 64.0, "peers": 4, "rate": "100mbit", "netns": False}),
        (["bench", "transport"], {"rtt": "0ms", "jitter": "0ms", "loss": 0.0, "seconds": 6.0}),
        (["bench", "digits"], {"peers": 3, "max_delay": None, "strategies": None}),
        (["bench", "memory"], {"params": 32_000_000, "period": 4, "device": "cpu", "strategies": None}),
        (
            ["bench", "memory", "--params", "5e6", "--strategies", "diloco"],
            {"params": 5_000_000, "strategies": ["diloco"]},
        ),
        (["bench", "strategies", "--codec", "INT8"], {"codec": "int8"}),
        (["bench", "lm", "--json", "-v"], {"json": True, "verbose": 1, "what": "lm"}),
        (["bench", "lm"], {"loss": 0.0, "jitter": "0ms"}),
        (["bench", "lm", "--rtt", "80ms", "--loss", "0.1%"], {"rtt": "80ms", "loss": pytest.approx(0.001)}),
        (["bench", "lm", "--loss", "0.02", "--jitter", "5ms"], {"loss": 0.02, "jitter": "5ms"}),
        (["-vv", "bench", "lm"], {"verbose": 2}),
    ],
)
def test_each_bench_has_its_own_defaults(argv: list[str], expected: dict[str, object]) -> None:
    args = vars(parse(argv))
    assert {key: args[key] for key in expected} == expected


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench", "transport", "--rtt", "100ms"], "transport emulates them only with --netns"),
        (["bench", "transport", "--loss", "1%"], "transport emulates them only with --netns"),
        (["bench", "chaos", "--peers", "2"], "argument --peers: chaos needs more than --max-down (2)"),
        (["bench", "chaos", "--down", "5", "1"], "argument --down: need 0 <= MIN <= MAX"),
        (["bench", "chaos", "--kinds", "kill,freeze"], "--kinds must be distinct ones of kill, stop, partition"),
        (["bench", "chaos", "--kinds", "stop,stop"], "--kinds must be distinct ones of kill, stop, partition"),
        (["bench", "chaos", "--kinds", ","], "argument --kinds: name at least one fault kind"),
        (["bench", "chaos", "--stop-min", "9", "--stop-max", "2"], "need 0 <= --stop-min <= --stop-max, got 9.0, 2.0"),
        (["bench", "chaos", "--stop-max", "200"], "--long-stop-max must be >= --stop-max, got 180.0, 200.0"),
        (["bench", "chaos", "--partition-min", "40"], "need 0 <= --partition-min <= --partition-max"),
        (["bench", "chaos", "--long-stop-p", "1.5"], "--long-stop-p must be in [0, 1], got 1.5"),
        (["bench", "chaos", "--oneway-p", "2"], "--oneway-p must be in [0, 1], got 2.0"),
        (["bench", "chaos", "--stop-min=-1"], "argument --stop-min: must be a finite number >= 0"),
        (["bench", "lm", "--period", "4", "--max-delay", "4"], "--max-delay (4) must be less than --period (4)"),
        (["bench", "regions", "--strategies", "ssgd", "dreamddp"], "regions runs one strategy"),
        (["bench", "allreduce", "--peers", "1"], "argument --peers: must be >= 2"),
        (["bench", "memory", "--params", "12"], "argument --params: must be a whole number from 1000 to 1e12"),
        (["bench", "memory", "--params", "2500.5"], "argument --params: must be a whole number from 1000 to 1e12"),
        (["bench", "memory", "--params", "big"], "argument --params: expected a count such as 32e6"),
        (["bench", "memory", "--strategies", "diloco", "fsdp"], "argument --strategies: unknown fsdp; choose from"),
        (["bench", "memory", "--ranks", "0"], "argument --ranks: expected distinct region sizes from 1 to 64"),
        (["bench", "memory", "--ranks", "2,2"], "argument --ranks: expected distinct region sizes from 1 to 64"),
        (["bench", "memory", "--ranks", "two"], "argument --ranks: expected region sizes such as 1,2,4"),
        (["bench", "memory", "--ranks", "2", "--device", "cuda"], "FSDP2 regions are measured on the CPU"),
        (["bench", "nope"], "argument BENCH: invalid choice: 'nope'"),
        (["bench", "lm", "--loss", "abc"], "argument --loss: cannot parse loss 'abc'"),
        (["bench", "lm", "--loss", "100%"], "argument --loss: loss must be a fraction in [0, 1)"),
        (["bench", "lm", "--loss=-0.1%"], "argument --loss: loss must be a fraction in [0, 1)"),
        (["bench", "lm", "--loss", "1.5"], "argument --loss: loss must be a fraction in [0, 1)"),
        (["bench", "lm", "--jitter", "fast"], "argument --jitter:"),
        (["bench", "lm", "--loss", "nan"], "argument --loss: loss must be a fraction in [0, 1)"),
        (["bench", "chaos", "--loss", "100%"], "argument --loss: loss must be a fraction in [0, 1)"),
        (
            ["bench", "regions", "--loss", "1%"],
            "argument --loss: not an option of bench regions; bench transport, lm, chaos",
        ),
    ],
)
def test_checks_across_options(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert message in usage_error(argv, capsys)


# the commands README.md, docs/, deploy/ and the Makefile give (placeholders filled in)
DOC_COMMANDS = """
dreamp2p bench codec --json
dreamp2p bench transport --json
dreamp2p bench allreduce --json
dreamp2p bench strategies --json
dreamp2p bench chaos --json
dreamp2p bench regions --json
dreamp2p bench digits --json
dreamp2p bench memory --json
dreamp2p bench memory --json --params 32e6
dreamp2p bench soak --minutes 10 --json
dreamp2p bench chaos --minutes 10 --json
dreamp2p bench transport --json --netns --rate 100mbit
dreamp2p bench transport --netns --rtt 100ms --loss 0.1%
dreamp2p bench transport --netns --rate 100mbit --rtt 100ms --loss 0.1% --seconds 10 --streams 4 --json
dreamp2p bench allreduce --json --peers 4 --mbytes 64
dreamp2p bench allreduce --json --peers 2 --mbytes 6.64 --repeats 5 --codecs int4 fp32 --netns --rate 100mbit
dreamp2p bench strategies --json --strategies none streaming dreamddp
dreamp2p bench strategies --device cuda --width 2048 --depth 4 --batch 65536 --lr 0.01 --steps 100 --json
dreamp2p bench lm --json --steps 200
dreamp2p bench lm --strategies dreamddp:error_feedback=true dreamddp:delta_codec=topk,error_feedback=true
dreamp2p bench lm --json --rate 1mbit --strategies 'dreamddp:delta_fallbacks=["int2","topk"],keep_unsent=true'
dreamp2p bench lm --json --rate 100mbit --regions 2 --steps 200 --bracket --rounds 4 --strategies streaming dreamddp
dreamp2p bench lm --json --rate 20mbit --regions 3 --steps 200 --bracket --strategies none dreamddp streaming
dreamp2p bench lm --json --rtt 80ms --loss 0.1% --strategies dreamddp
dreamp2p bench plancheck --json --steps 100 --period 20 --sizes small --rates 20mbit 100mbit 10mbit --rtts 0ms 80ms
dreamp2p bench plancheck --json --sizes small large --region-counts 2 3 --out grid.jsonl
dreamp2p bench plancheck --reports grid.jsonl out.json
dreamp2p bench plancheck --json --target-cu 0.9 --sizes small --rates 20mbit --rtts 0ms --region-counts 2
dreamp2p bench chaos --json --minutes 0.5 --kill-every 6 --down 1 3 --flap-every 20 --flap-down 4 --run-dir r
dreamp2p bench chaos --minutes 1.5 --json
dreamp2p bench chaos --json --kinds kill,stop --stop-min 1 --stop-max 5 --long-stop-p 0.2 --long-stop-max 60
dreamp2p bench chaos --json --partition-min 2 --partition-max 8 --oneway-p 1
dreamp2p bench regions --json --steps 3 --width 32 --depth 1 --rate 50mbit
"""


@pytest.mark.parametrize("command", DOC_COMMANDS.strip().splitlines())
def test_the_documented_commands_parse(command: str) -> None:
    argv = shlex.split(command)[1:]
    assert parse(argv).what == argv[1]
