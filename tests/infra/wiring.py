"""Offline stand-ins for `terraform validate`: each function lists the problems of one kind in
one configuration directory (empty: none)."""

from __future__ import annotations

from pathlib import Path

from lark import Tree

from tests.infra.hcl_eval import Evaluator
from tests.infra.hcl_tree import (
    MODULE_META_ARGUMENTS,
    SPECIAL_ROOTS,
    ModuleConfig,
    Reference,
    name_of,
    references,
    subtrees,
    template_parts,
)


def load_tree(terraform_dir: Path) -> dict[str, ModuleConfig]:
    """The root ('.') and every module ('modules/<name>') under a Terraform directory."""
    modules = terraform_dir / "modules"
    names = sorted(p.name for p in modules.iterdir() if p.is_dir()) if modules.is_dir() else []
    paths = [".", *(f"modules/{name}" for name in names)]
    return {p: ModuleConfig.load((terraform_dir / p).resolve()) for p in paths}


def all_references(config: ModuleConfig) -> list[tuple[str, Reference]]:
    return [
        (where, ref)
        for where, tree, bound in config.expressions()
        for ref in references(tree, bound)
    ]


def _named(config: ModuleConfig, root: str) -> set[str]:
    return {
        str(ref.steps[0]) for _, ref in all_references(config) if ref.root == root and ref.steps
    }


def declaration_problems(config: ModuleConfig, kind: str) -> list[str]:
    """`kind` is "var" or "local": used but undeclared, and declared but unused, names."""
    declared = set(config.variables if kind == "var" else config.locals)
    used = _named(config, kind)
    return [f"{kind}.{n} is used but not declared" for n in sorted(used - declared)] + [
        f"{kind}.{n} is declared but never used" for n in sorted(declared - used)
    ]


def module_target(
    config: ModuleConfig, call: str, configs: dict[str, ModuleConfig]
) -> ModuleConfig | None:
    source = Evaluator().evaluate(config.module_calls[call].attributes["source"])
    directory = (config.directory / source).resolve()
    return next((c for c in configs.values() if c.directory == directory), None)


def module_call_problems(config: ModuleConfig, configs: dict[str, ModuleConfig]) -> list[str]:
    problems = []
    for call, block in config.module_calls.items():
        target = module_target(config, call, configs)
        if target is None:
            problems.append(f"module {call}: its source is not a configuration directory")
            continue
        passed = set(block.attributes) - MODULE_META_ARGUMENTS
        for name in sorted(passed - set(target.variables)):
            problems.append(f"module {call}: passes {name!r}, which the module does not declare")
        for name in sorted(target.required_variables() - passed):
            problems.append(f"module {call}: does not pass the required variable {name!r}")
    return problems


def output_problems(config: ModuleConfig, configs: dict[str, ModuleConfig]) -> list[str]:
    """module.<call>.<output> and `for x in module.<call> : x.<output>` name real outputs."""
    outputs = {}
    for call in config.module_calls:
        target = module_target(config, call, configs)
        outputs[call] = set(target.outputs) if target else set()
    problems = []
    for where, ref in all_references(config):
        if ref.root != "module":
            continue
        call = str(ref.steps[0])
        named = [s for s in ref.steps[1:] if isinstance(s, str)]
        if call not in outputs:
            problems.append(f"{where}: no module {call!r}")
        elif named and named[0] not in outputs[call]:
            problems.append(f"{where}: module {call} has no output {named[0]!r}")
    for where, tree, _ in config.expressions():
        for loop in tree.iter_subtrees():
            if loop.data in ("for_tuple_expr", "for_object_expr"):
                problems += _loop_output_problems(where, loop, outputs)
    return problems


def _loop_output_problems(where: str, loop: Tree, outputs: dict[str, set[str]]) -> list[str]:
    intro, *body = subtrees(loop)
    names = [name_of(n) for n in subtrees(intro) if n.data == "identifier"]
    collection = list(references(subtrees(intro)[-1]))
    if len(collection) != 1 or collection[0].root != "module" or len(collection[0].steps) != 1:
        return []
    call = str(collection[0].steps[0])
    return [
        f"{where}: module {call} has no output {ref.steps[0]!r}"
        for part in body
        for ref in references(part)
        if ref.root == names[-1] and ref.steps and ref.steps[0] not in outputs.get(call, set())
    ]


def resource_problems(config: ModuleConfig) -> list[str]:
    resources = {f"{t}.{n}" for t, n in config.resources}
    data = {f"{t}.{n}" for t, n in config.data_sources}
    problems = []
    for where, ref in all_references(config):
        if ref.root == "data":
            if f"{ref.steps[0]}.{ref.steps[1]}" not in data:
                problems.append(f"{where}: no data source {ref.steps[0]}.{ref.steps[1]}")
        elif ref.root not in SPECIAL_ROOTS:
            if not ref.steps:
                problems.append(f"{where}: {ref.root!r} refers to nothing")
            elif f"{ref.root}.{ref.steps[0]}" not in resources:
                problems.append(f"{where}: no resource {ref.root}.{ref.steps[0]}")
    return problems


def template_problems(config: ModuleConfig) -> tuple[int, list[str]]:
    """(templatefile calls seen, problems): each template exists and gets exactly what it uses."""
    seen, problems = 0, []
    for where, tree, _ in config.expressions():
        for node in tree.iter_subtrees():
            if node.data != "function_call" or name_of(subtrees(node)[0]) != "templatefile":
                continue
            seen += 1
            path_tree, variables_tree = subtrees(subtrees(node)[1])
            path = Path(Evaluator(directory=config.directory).evaluate(path_tree))
            if not path.is_file():
                problems.append(f"{where}: template {path} does not exist")
                continue
            used = {
                ref.root
                for part in template_parts(path.read_text())
                if isinstance(part, Tree)
                for ref in references(part)
            }
            passed = {_key_name(element) for element in subtrees(_unwrap(variables_tree))}
            if used != passed:
                problems.append(f"{where}: template uses {sorted(used)}, gets {sorted(passed)}")
    return seen, problems


def _unwrap(tree: Tree) -> Tree:
    while tree.data == "expr_term" and len(subtrees(tree)) == 1:
        tree = subtrees(tree)[0]
    return tree


def _key_name(element: Tree) -> str:
    return name_of(_unwrap(subtrees(subtrees(element)[0])[0]))
