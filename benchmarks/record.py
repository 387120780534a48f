"""Write sections that a run left in its output folder (NAME.md) into RESULTS.md, each in
place of the section of the same title: the step after fetching a GPU machine's $OUT.

    python -m benchmarks record $OUT/e2e.md [--results benchmarks/RESULTS.md]
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks import harness

HELP = "write sections (NAME.md from --out) into RESULTS.md"


def add_arguments(p: Any) -> None:
    p.add_argument("sections", nargs="+", metavar="NAME.md")
    p.add_argument("--results", default=str(harness.RESULTS), metavar="RESULTS.md")


def run(args: Any, argv: list[str]) -> int:
    for path in args.sections:
        harness.write_section(Path(args.results), Path(path).read_text())
        print(f"{path} -> {args.results}")
    return 0
