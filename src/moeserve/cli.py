"""The `moeserve` command: plan (and, as the runtime lands, generate, bench, serve)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional

from moeserve.config import add_config_arguments, config_from_args
from moeserve.models.spec import ModelSpecError


def _plan(args: argparse.Namespace) -> int:
    from moeserve.plan.capacity import build_plan
    from moeserve.plan.report import print_plan

    plan = build_plan(config_from_args(args))
    if args.json:
        print(json.dumps(plan.to_json(), indent=2))
    else:
        print_plan(plan)
    return 0 if plan.ok else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moeserve", description="Serve mixture-of-experts "
                                     "language models, with every buffer planned up front.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="print the capacity plan for a config, and its errors")
    add_config_arguments(p)
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    p.set_defaults(func=_plan)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ModelSpecError as exc:
        print(f"moeserve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
