"""What each test file cost in a full run, and the test order that puts the costliest first.

`make test` runs the files on two xdist workers, one file per worker at a time
(`--dist loadfile`). xdist hands them out in collection order, and by default it first sorts
them by their number of tests, which puts the e2e files (few tests, each starting sites and a
gateway: one to two minutes a file) last: one worker then ran the last of them alone while the
other had nothing left. Handed out costliest first, the run ends on the quick files and both
workers finish together.

tests/file_costs.json holds each file's seconds in a full run (setup, call and teardown of its
tests, the module's fixtures included). A file it does not name (a new one) counts as the
median file. Refresh it from a run's JUnit report:

    make test PYTEST_ARGS=--junitxml=/tmp/report.xml
    python -m tests.support.file_costs /tmp/report.xml
"""

from __future__ import annotations

import json
import statistics
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path

COSTS_FILE = Path(__file__).resolve().parent.parent / "file_costs.json"


def load_costs(path: Path = COSTS_FILE) -> dict[str, float]:
    """{test file relative to the repository: seconds}; {} if there is no table."""
    if not path.is_file():
        return {}
    costs = json.loads(path.read_text())
    return {str(k): float(v) for k, v in costs.items()}


def costliest_first(files: Sequence[str], costs: Mapping[str, float]) -> list[str]:
    """`files` (distinct, in their order), the costliest first; an unknown file counts as the
    median of the known ones. Ties keep their order (a stable sort)."""
    known = [costs[f] for f in files if f in costs]
    default = statistics.median(known) if known else 0.0
    return sorted(files, key=lambda f: -costs.get(f, default))


def costs_from_junit(report: Path) -> dict[str, float]:
    """Seconds per test file in a JUnit report of a run (pytest's `--junitxml`)."""
    totals: defaultdict[str, float] = defaultdict(float)
    for case in ET.parse(report).getroot().iter("testcase"):
        classname = case.get("classname", "")
        file = case.get("file")
        if not file:  # pytest names the module as a dotted class name
            parts = classname.split(".")
            while parts and not parts[-1].startswith("test_"):
                parts.pop()  # a test class inside the module
            file = "/".join(parts) + ".py"
        totals[file] += float(case.get("time", "0") or 0)
    return {file: round(seconds, 2) for file, seconds in sorted(totals.items())}


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m tests.support.file_costs REPORT.xml", file=sys.stderr)
        return 2
    costs = costs_from_junit(Path(args[0]))
    COSTS_FILE.write_text(json.dumps(costs, indent=1, sort_keys=True) + "\n")
    top = sorted(costs.items(), key=lambda item: -item[1])[:5]
    print(f"{len(costs)} files, {sum(costs.values()):.0f} s in all; costliest: {top}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
