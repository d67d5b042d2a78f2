"""A newcomer's first hour (issue 67): without the shared datasets `make demo` ended in a
DatasetError traceback, and Ctrl-C while its requests were in flight printed a 40-line one.
Now the demo runs on built-in prompts and says where the datasets come from, and Ctrl-C prints
one line, stops what was started and exits 130."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from devtools import demo
from devtools.demo_prompts import BUILTIN_PROMPTS, DEMO_FILES, builtin_workload
from devtools.launch import ManagedProcess


@pytest.fixture
def no_shared(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No dataset anywhere the demo looks."""
    monkeypatch.delenv("FEDLLM_DATA_DIR", raising=False)
    monkeypatch.setenv("FEDLLM_SHARED_DIR", str(tmp_path / "nowhere"))
    monkeypatch.setattr("devtools.demo_prompts.DEFAULT_DATA_DIR", tmp_path / "absent")
    return tmp_path


def test_without_datasets_the_demo_sends_built_in_prompts_and_says_where_data_comes_from(
    no_shared: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = demo.locate_datasets(demo.parse_args(["--requests", "30"]))
    notice = capsys.readouterr().out
    assert args.data_dir is None
    assert args.no_predictor
    for named in ("FEDLLM_SHARED_DIR", "FEDLLM_DATA_DIR", "../shared/datasets", "demo_prompts"):
        assert named in notice
    assert notice.count("\n") == 1  # one paragraph
    workload = demo.build_workload(args)
    assert len(workload) == 30
    assert {r.prompt for r in workload} == {r.prompt for r in BUILTIN_PROMPTS}
    assert builtin_workload(24, 7) == builtin_workload(24, 7)


def test_the_datasets_are_found_through_the_shared_folders_variable(
    no_shared: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shared = no_shared / "shared"
    (shared / "datasets").mkdir(parents=True)
    for name in DEMO_FILES:
        (shared / "datasets" / name).write_text("")
    monkeypatch.setenv("FEDLLM_SHARED_DIR", str(shared))
    args = demo.locate_datasets(demo.parse_args([]))
    assert args.data_dir == shared / "datasets"
    assert not args.no_predictor


def test_the_built_in_prompts_cover_the_demos_three_kinds() -> None:
    kinds = {record.corpus for record in BUILTIN_PROMPTS}
    assert kinds == {"builtin:instruction", "builtin:context", "builtin:maths"}
    assert len({record.prompt for record in BUILTIN_PROMPTS}) == len(BUILTIN_PROMPTS) >= 24


def test_ctrl_c_prints_one_line_stops_the_services_and_exits_130(
    no_shared: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    stopped: list[list[ManagedProcess]] = []
    fake = ManagedProcess("site", None, no_shared / "log")  # type: ignore[arg-type]

    def started(*_: object, **__: object) -> list[ManagedProcess]:
        return [fake]

    def interrupted(*_: object, **__: object) -> object:
        raise KeyboardInterrupt  # as Ctrl-C lands while the sites start

    monkeypatch.setattr(demo, "materialize", lambda path: path)
    monkeypatch.setattr(demo, "bundled_gguf", lambda: no_shared)
    monkeypatch.setattr(demo, "start_sites", started)
    monkeypatch.setattr(demo, "write_federation", interrupted)
    monkeypatch.setattr(demo, "stop_all", stopped.append)
    with pytest.raises(SystemExit) as exited:
        demo.main(["--work-dir", str(no_shared / "work")])
    assert exited.value.code == 130
    assert stopped == [[fake]]
    err = capsys.readouterr().err
    (line,) = err.strip().splitlines()
    assert line == "interrupted: the sites and the gateway it started are stopped"
    assert "Traceback" not in err


def test_locate_datasets_keeps_every_other_argument(no_shared: Path) -> None:
    args = demo.parse_args(["--requests", "3", "--seed", "1"])
    located = demo.locate_datasets(args)
    assert isinstance(located, argparse.Namespace)
    assert (located.requests, located.seed) == (3, 1)
