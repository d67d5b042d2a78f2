"""The test order by file cost (tests/support/file_costs.py): the costliest files first, an
unknown file at the median, and the costs read back from a JUnit report."""

from __future__ import annotations

from pathlib import Path

from tests.support.file_costs import costliest_first, costs_from_junit

REPORT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="4">
<testcase classname="tests.e2e.test_slow_http" name="test_a" time="60.5" />
<testcase classname="tests.e2e.test_slow_http" name="test_b" time="39.5" />
<testcase classname="tests.unit.test_quick.TestGroup" name="test_c" time="0.25" />
<testcase classname="tests.unit.test_quick" name="test_d" time="0.75" />
</testsuite></testsuites>
"""


def test_the_costliest_files_go_first_and_an_unknown_one_at_the_median() -> None:
    costs = {"a.py": 1.0, "b.py": 100.0, "c.py": 10.0}
    assert costliest_first(["a.py", "b.py", "c.py"], costs) == ["b.py", "c.py", "a.py"]
    # new.py is unknown: the median (10 s), after c.py, which was listed before it
    assert costliest_first(["a.py", "c.py", "new.py", "b.py"], costs) == [
        "b.py", "c.py", "new.py", "a.py",
    ]  # fmt: skip
    assert costliest_first(["x.py", "y.py"], {}) == ["x.py", "y.py"]


def test_costs_are_summed_per_file_from_a_junit_report(tmp_path: Path) -> None:
    report = tmp_path / "report.xml"
    report.write_text(REPORT)
    assert costs_from_junit(report) == {
        "tests/e2e/test_slow_http.py": 100.0,
        "tests/unit/test_quick.py": 1.0,
    }
