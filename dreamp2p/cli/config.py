"""`dreamp2p config check FILE`: every error of a node's TOML file at once (`dreamp2p.config.check`), exit 1 if any;
`dreamp2p config token`: a fresh per-node token and the digest its ring entry lists on every node."""

from __future__ import annotations

import argparse
import json
import secrets
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


def run_token(args: argparse.Namespace) -> int:
    from dreamp2p.config import token_digest

    token = secrets.token_urlsafe(32)
    if args.json:
        print(json.dumps({"token": token, "token_sha256": token_digest(token)}))
        return 0
    print(f'token = "{token}"  # this node\'s [node] token (or put it in the variable token_env names); keep it secret')
    print(f"token_sha256 = \"{token_digest(token)}\"  # this node's ring entry, in every node's file")
    return 0


def add_config_parser(sub: Any) -> None:
    c = sub.add_parser("config", help="check a node's TOML file, or make a per-node token")
    actions = c.add_subparsers(dest="action", required=True)
    check = actions.add_parser("check", help="report every error of the file at once; exit 1 if there is one")
    check.add_argument("file", type=Path, help="the node's TOML file")
    check.add_argument("--json", action="store_true", help="print one JSON object: file, ok, errors")
    check.set_defaults(func=run_check)
    token = actions.add_parser(
        "token", help="make a per-node token: its line for this node's file and its digest for every node's ring"
    )
    token.add_argument("--json", action="store_true", help="print one JSON object: token, token_sha256")
    token.set_defaults(func=run_token)
