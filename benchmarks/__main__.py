"""python -m benchmarks SUBCOMMAND [args]: see benchmarks/__init__.py."""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Optional, Sequence

# subcommand -> module of this package; each module has HELP, add_arguments(p) and
# run(args, argv) -> exit status
SUBCOMMANDS = {"e2e": "e2e", "moe": "moe", "attention": "attention", "mla": "mla",
               "a2a": "a2a", "collectives": "collectives", "scaleout": "scaleout",
               "tune-moe": "tune_moe", "record": "record", "structured": "structured",
               "coldstart": "coldstart", "outputs": "outputs", "masks": "masks"}


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m benchmarks",
                                description="moeserve's benchmarks (run from the repository "
                                            "root with PYTHONPATH=src)")
    sub = p.add_subparsers(dest="subcommand", required=True, metavar="SUBCOMMAND")
    modules = {name: importlib.import_module(f"benchmarks.{mod}")
               for name, mod in SUBCOMMANDS.items()}
    for name, mod in modules.items():
        sp = sub.add_parser(name, help=mod.HELP, description=mod.__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_arguments(sp)
    args = p.parse_args(argv)
    return modules[args.subcommand].run(args, argv[argv.index(args.subcommand) + 1:])


if __name__ == "__main__":
    sys.exit(main())
