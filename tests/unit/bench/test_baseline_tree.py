"""The baseline engine's copy of the tree must hold every first-party module the serving
benchmark reaches through its imports: the GPU machine has none of them installed, so a module
left out of the copy stops the baseline there (it once left out fedllm_contract)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from bench.engine.baseline_engine import hybrid_tree
from bench.engine.paths import REPO_ROOT

FIRST_PARTY = {p.name for p in REPO_ROOT.iterdir() if (p / "__init__.py").is_file()}


def module_file(root: Path, module: str) -> Path | None:
    base = root.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def imported_modules(source: Path) -> set[str]:
    """Absolute imports of first-party modules (both `import a.b` and `from a.b import c`,
    where c may itself be a module)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source.read_text(), str(source))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in found if name.split(".")[0] in FIRST_PARTY}


def unresolved_imports(root: Path, start: str) -> set[str]:
    """First-party modules reachable from `start` that `root` does not hold."""
    missing, seen, todo = set(), set(), [start]
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        path = module_file(root, module)
        if path is None:
            parent = module.rpartition(".")[0]
            if module_file(root, parent) is None:  # `from pkg import name` of a plain name is fine
                missing.add(module)
            continue
        todo.extend(imported_modules(path))
    return missing


def test_the_copy_holds_every_module_the_serving_benchmark_reaches(tmp_path: Path) -> None:
    copy = hybrid_tree(REPO_ROOT / "site_engine" / "engine", tmp_path / "tree")
    assert unresolved_imports(copy, "bench.engine.serving") == set()


def test_the_check_sees_a_package_left_out(tmp_path: Path) -> None:
    copy = hybrid_tree(REPO_ROOT / "site_engine" / "engine", tmp_path / "tree")
    (copy / "fedllm_contract" / "__init__.py").unlink()
    for module in (copy / "fedllm_contract").glob("*.py"):
        module.unlink()
    assert any(
        name.startswith("fedllm_contract")
        for name in unresolved_imports(copy, "bench.engine.serving")
    )


def test_a_folder_that_is_no_engine_package_is_refused(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="not a site_engine/engine package"):
        hybrid_tree(tmp_path, tmp_path / "tree")
