"""`dreamp2p` command line: argument parsing and printing only; the work lives in the library.

This package holds `main` and the parser of every subcommand; each subcommand's parser and handler is a
module of it (`node`, `status`, `config`, `plan`), their value types are in `args`, and the developer
subcommands come through entry points.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import entry_points
from typing import Any

from dreamp2p import __version__
from dreamp2p.cli.config import add_config_parser
from dreamp2p.cli.node import add_health_parser, add_node_parser, exit_now
from dreamp2p.cli.plan import add_plan_parser
from dreamp2p.cli.status import add_status_parser
from dreamp2p.errors import PeerError
from dreamp2p.messages import PROTOCOL_VERSION

log = logging.getLogger(__name__)

# exit status of a process killed by SIGPIPE (128 + 13), what `yes | head -1` reports for `yes`
EXIT_BROKEN_PIPE = 141


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dreamp2p", description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-v info, -vv debug)")
    p.add_argument("--version", action="version", version=f"dreamp2p {__version__} (wire protocol {PROTOCOL_VERSION})")
    sub = _Subcommands(p.add_subparsers(dest="command", required=True))
    adders = {**_plugin_commands(), **_CORE_COMMANDS}
    # the listing order of `dreamp2p --help`; a plugin command not named there comes after
    for name in sorted(adders, key=lambda n: _ORDER.index(n) if n in _ORDER else len(_ORDER)):
        adders[name](sub)
    return p


# name -> function adding the subcommand's parser to the `_Subcommands` it is given
AddParser = Callable[[Any], None]
_CORE_COMMANDS: dict[str, AddParser] = {
    "node": add_node_parser,
    "status": add_status_parser,
    "config": add_config_parser,
    "health": add_health_parser,
    "plan": add_plan_parser,
}
_ORDER = ("bench", "node", "status", "health", "config", "plan", "demo", "report")
# The developer subcommands (bench, demo, report) live in dreamp2p.devtools, above the console script in the
# layering: they are found by this entry-point group (pyproject.toml), a name rather than an import.
COMMAND_GROUP = "dreamp2p.commands"


def _plugin_commands() -> dict[str, AddParser]:
    """The subcommands other packages declare in COMMAND_GROUP (an entry named ``bench`` adds ``bench``)."""
    adders: dict[str, AddParser] = {}
    for entry in entry_points(group=COMMAND_GROUP):
        adders[entry.name] = entry.load()
    return adders


class _Subcommands:
    """Adds subcommands that also take ``-v`` after their name (``dreamp2p node -v``), like before it."""

    def __init__(self, action: Any) -> None:
        self._action = action
        self._common = argparse.ArgumentParser(add_help=False)
        # SUPPRESS: absent after the subcommand, the count given before it stands
        self._common.add_argument(
            "-v", "--verbose", action="count", default=argparse.SUPPRESS, help="more logging (-v info, -vv debug)"
        )

    def add_parser(self, name: str, **kw: Any) -> argparse.ArgumentParser:
        parser: argparse.ArgumentParser = self._action.add_parser(name, parents=[self._common], **kw)
        return parser


def _exit_on_signal(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    # gRPC core logs each failed TLS handshake (and more) at INFO on stderr: a node refusing a member's expired
    # certificate printed a line per attempt, several a second. Only its errors, unless the environment asks
    # for more; read once, when grpc is first imported, which the subcommands do later (and child processes
    # inherit it). The errors of our own calls name certificate problems (dreamp2p.transport.tlsfailure).
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    try:
        args = build_parser().parse_args(argv)
        check = getattr(args, "check", None)
        if check is not None:
            check(args)  # checks across options; exits 2 with a usage message, like argparse's own
        level = [logging.WARNING, logging.INFO, logging.DEBUG][min(args.verbose, 2)]
        logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        # SIGTERM unwinds like Ctrl-C, so benches and the demo remove the namespaces and child processes
        # they made (the node daemon installs its own handler: it drains and checkpoints instead)
        signal.signal(signal.SIGTERM, _exit_on_signal)
        try:
            code = int(args.func(args))
        except BrokenPipeError:
            raise  # stdout's reader went away (`dreamp2p plan | head`): not an error of the command
        except Exception as exc:
            if getattr(args, "log_errors", False):  # a node: its log (maybe JSON) carries the error and traceback
                log.exception("stopped by an error: %s", exc, extra={"event": "error"})
                exit_now(1)
            elif isinstance(exc, ValueError | RuntimeError | OSError | PeerError):
                print(f"dreamp2p: error: {exc}", file=sys.stderr)
            else:
                raise
            code = 1
        sys.stdout.flush()  # a closed pipe shows up here when the output was still buffered
        return code
    except BrokenPipeError:
        # nobody reads stdout any more: point it at /dev/null so the interpreter's final flush stays quiet
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_BROKEN_PIPE
