"""`dreamp2p config check FILE`: every error of a node's TOML file at once (`dreamp2p.config.check`), exit 1 if any."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def run_check(args: argparse.Namespace) -> int:
    from dreamp2p.config import check_file

    errors = check_file(args.file)
    if args.json:
        print(json.dumps({"file": str(args.file), "ok": not errors, "errors": errors}))
    elif errors:
        for error in errors:
            print(f"{args.file}: {error}")
        print(f"{args.file}: {len(errors)} error{'s' if len(errors) > 1 else ''}")
    else:
        print(f"{args.file}: ok")
    return 1 if errors else 0


def add_config_parser(sub: Any) -> None:
    c = sub.add_parser("config", help="check a node's TOML file")
    actions = c.add_subparsers(dest="action", required=True)
    check = actions.add_parser("check", help="report every error of the file at once; exit 1 if there is one")
    check.add_argument("file", type=Path, help="the node's TOML file")
    check.add_argument("--json", action="store_true", help="print one JSON object: file, ok, errors")
    check.set_defaults(func=run_check)
