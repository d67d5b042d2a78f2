"""Terraform configurations as python-hcl2 parse trees: blocks, and the references expressions make.

No terraform binary or provider can be downloaded where CI runs, so the checks read the HCL
themselves: python-hcl2's raw Lark tree keeps every expression's structure, which both the
reference walker here and the evaluator (hcl_eval.py) work on.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import hcl2
from lark import Token, Tree

TERRAFORM_DIR = Path(__file__).resolve().parents[2] / "infra" / "terraform"
# Arguments of a module block that are not input variables.
MODULE_META_ARGUMENTS = frozenset(
    {"source", "version", "for_each", "count", "depends_on", "providers"}
)
# Root names of references that are not resources.
SPECIAL_ROOTS = frozenset({"var", "local", "module", "data", "each", "count", "path", "self"})


class HclError(ValueError):
    """The HCL is malformed or uses something these checks do not understand."""


def parse_text(text: str) -> Tree:
    # python-hcl2's grammar needs a trailing newline.
    tree: Tree = hcl2.parses_to_tree(text if text.endswith("\n") else text + "\n")
    return tree


def parse_expression(text: str) -> Tree:
    body = subtrees(parse_text(f"x = {text}\n"))[0]
    return subtrees(subtrees(body)[0])[1]


def subtrees(tree: Tree) -> list[Tree]:
    return [c for c in tree.children if isinstance(c, Tree) and c.data != "new_line_or_comment"]


def name_of(tree: Tree) -> str:
    """The text of an identifier, keyword, literal or quoted label."""
    if tree.data == "string":
        return "".join(str(t) for part in subtrees(tree) for t in part.children)
    token = tree.children[0]
    return str(token.children[0]) if isinstance(token, Tree) else str(token)


@dataclass
class Block:
    type: str
    labels: tuple[str, ...]
    attributes: dict[str, Tree]
    blocks: list[Block]
    file: Path

    def children(self, block_type: str) -> list[Block]:
        return [b for b in self.blocks if b.type == block_type]


def _block(tree: Tree, file: Path) -> Block:
    parts = subtrees(tree)
    body = parts[-1]
    attributes: dict[str, Tree] = {}
    blocks: list[Block] = []
    for item in subtrees(body):
        if item.data == "attribute":
            key, expression = subtrees(item)
            attributes[name_of(key)] = expression
        elif item.data == "block":
            blocks.append(_block(item, file))
    return Block(
        name_of(parts[0]), tuple(name_of(p) for p in parts[1:-1]), attributes, blocks, file
    )


def parse_blocks(path: Path) -> list[Block]:
    tree = parse_text(path.read_text())
    return [_block(item, path) for item in subtrees(subtrees(tree)[0]) if item.data == "block"]


def parse_attributes(path: Path) -> dict[str, Tree]:
    """The top-level attributes of a file (a .tfvars file)."""
    body = subtrees(parse_text(path.read_text()))[0]
    found: dict[str, Tree] = {}
    for item in subtrees(body):
        if item.data != "attribute":
            raise HclError(f"{path}: only attributes are allowed in a .tfvars file")
        key, expression = subtrees(item)
        found[name_of(key)] = expression
    return found


@dataclass
class ModuleConfig:
    """One directory of .tf files: the root configuration or a module."""

    directory: Path
    blocks: list[Block] = field(default_factory=list)

    @classmethod
    def load(cls, directory: Path) -> ModuleConfig:
        files = sorted(directory.glob("*.tf"))
        if not files:
            raise HclError(f"no .tf files in {directory}")
        return cls(directory, [b for f in files for b in parse_blocks(f)])

    def _labelled(self, block_type: str) -> dict[str, Block]:
        return {b.labels[0]: b for b in self.blocks if b.type == block_type}

    @property
    def variables(self) -> dict[str, Block]:
        return self._labelled("variable")

    @property
    def outputs(self) -> dict[str, Block]:
        return self._labelled("output")

    @property
    def module_calls(self) -> dict[str, Block]:
        return self._labelled("module")

    @property
    def locals(self) -> dict[str, Tree]:
        return {k: v for b in self.blocks if b.type == "locals" for k, v in b.attributes.items()}

    @property
    def resources(self) -> dict[tuple[str, str], Block]:
        return {(b.labels[0], b.labels[1]): b for b in self.blocks if b.type == "resource"}

    @property
    def data_sources(self) -> dict[tuple[str, str], Block]:
        return {(b.labels[0], b.labels[1]): b for b in self.blocks if b.type == "data"}

    def required_variables(self) -> set[str]:
        return {name for name, b in self.variables.items() if "default" not in b.attributes}

    def expressions(self) -> Iterator[tuple[str, Tree, frozenset[str]]]:
        """(where, expression, names bound there) for every expression that may refer to things;
        variable types and lifecycle attribute lists are not expressions of that kind."""
        for block in self.blocks:
            where = f"{block.file.name}: {block.type} {'.'.join(block.labels)}"
            yield from _block_expressions(block, where, frozenset())


def _block_expressions(
    block: Block, where: str, bound: frozenset[str]
) -> Iterator[tuple[str, Tree, frozenset[str]]]:
    for key, expression in block.attributes.items():
        if (block.type == "variable" and key == "type") or block.type == "lifecycle":
            continue
        yield f"{where}.{key}", expression, bound
    for child in block.blocks:
        inner = bound
        if child.type == "dynamic":
            iterator = child.attributes.get("iterator")
            inner = bound | {name_of(iterator) if iterator is not None else child.labels[0]}
            for key in ("for_each", "labels"):
                if key in child.attributes:
                    yield f"{where}.dynamic.{key}", child.attributes[key], bound
            for content in child.children("content"):
                yield from _block_expressions(content, f"{where}.{child.labels[0]}", inner)
            continue
        yield from _block_expressions(child, f"{where}.{child.type}", inner)


# ---- references -----------------------------------------------------------------------------

Step = str | int | None  # attribute name, literal index, or None: computed index / splat


@dataclass(frozen=True)
class Reference:
    root: str
    steps: tuple[Step, ...]


_CHAINS = {"get_attr_expr_term", "index_expr_term", "attr_splat_expr_term", "full_splat_expr_term"}


def _literal_index(expression: Tree) -> Step:
    node = expression
    while node.data == "expr_term" and len(subtrees(node)) == 1:
        node = subtrees(node)[0]
    if node.data == "int_lit":
        return int(str(node.children[0]))
    if node.data == "string" and all(
        isinstance(t, Token) and t.type == "STRING_CHARS"
        for p in subtrees(node)
        for t in p.children
    ):
        return name_of(node)
    return None


def _unchain(tree: Tree) -> tuple[Tree, list[Step], list[Tree]]:
    """(base expression, access steps, computed index expressions) of an access chain."""
    steps: list[Step] = []
    computed: list[Tree] = []
    node = tree
    while node.data in _CHAINS or (node.data == "expr_term" and subtrees(node)[0].data in _CHAINS):
        if node.data == "expr_term":
            node = subtrees(node)[0]
            continue
        base, access = subtrees(node)
        tail: list[Step] = []
        for part in (
            [access]
            if node.data in ("get_attr_expr_term", "index_expr_term")
            else ([access, *subtrees(access)])
        ):
            if part.data == "get_attr":
                tail.append(name_of(subtrees(part)[0]))
            elif part.data == "short_index":
                tail.append(int(str(part.children[-1])))
            elif part.data == "braces_index":
                index = subtrees(part)[0]
                tail.append(_literal_index(index))
                computed.append(index)
            elif part.data in ("attr_splat", "full_splat"):
                tail.append(None)
        steps[:0] = tail
        node = base
    return node, steps, computed


def references(tree: Tree, bound: frozenset[str] = frozenset()) -> Iterator[Reference]:
    """Every reference an expression makes (var.x, module.m.out, aws_vpc.this.id, ...)."""
    data = tree.data
    if data in _CHAINS:
        base, steps, computed = _unchain(tree)
        for index in computed:
            yield from references(index, bound)
        inner = subtrees(base)
        if base.data == "expr_term" and len(inner) == 1 and inner[0].data == "identifier":
            name = name_of(inner[0])
            if name not in bound:
                yield Reference(name, tuple(steps))
        else:
            yield from references(base, bound)
        return
    if data == "identifier":
        name = name_of(tree)
        if name not in bound:
            yield Reference(name, ())
        return
    if data == "function_call":
        for part in subtrees(tree)[1:]:
            yield from references(part, bound)
        return
    if data == "object_elem_key":
        key = subtrees(tree)[0]
        if key.data == "expr_term" and subtrees(key) and subtrees(key)[0].data == "identifier":
            return  # a bare key is a name, not a reference
        yield from references(key, bound)
        return
    if data in ("for_tuple_expr", "for_object_expr"):
        intro, *rest = subtrees(tree)
        names = [name_of(n) for n in subtrees(intro) if n.data == "identifier"]
        yield from references(subtrees(intro)[-1], bound)
        looped = bound | set(names)
        for body in rest:
            yield from references(body, looped)
        return
    if data in ("heredoc_template", "heredoc_template_trim"):
        for piece in template_parts(heredoc_text(tree)):
            if isinstance(piece, Tree):
                yield from references(piece, bound)
        return
    for child in subtrees(tree):
        yield from references(child, bound)


# ---- templates (heredocs and templatefile) ---------------------------------------------------


def heredoc_text(tree: Tree) -> str:
    raw = str(tree.children[0])
    match = re.match(r"<<(-?)([A-Za-z][A-Za-z0-9._-]*)\r?\n(.*)\n\s*\2\s*$", raw, re.DOTALL)
    if match is None:
        raise HclError(f"unreadable heredoc: {raw[:40]!r}")
    lines = match.group(3).split("\n")
    if match.group(1):
        indents = [len(line) - len(line.lstrip()) for line in lines if line.strip()]
        cut = min(indents, default=0)
        lines = [line[cut:] for line in lines]
    return "\n".join(lines) + "\n"


def template_parts(text: str) -> list[str | Tree]:
    """Literal text and parsed ${...} expressions of a template; %{...} directives are refused."""
    parts: list[str | Tree] = []
    literal: list[str] = []
    i = 0
    while i < len(text):
        if text.startswith("$${", i) or text.startswith("%%{", i):
            literal.append(text[i + 1 : i + 3])
            i += 3
        elif text.startswith("%{", i):
            raise HclError("template directives (%{...}) are not supported by these checks")
        elif text.startswith("${", i):
            end = _closing_brace(text, i + 2)
            parts.append("".join(literal))
            literal = []
            parts.append(parse_expression(text[i + 2 : end].strip()))
            i = end + 1
        else:
            literal.append(text[i])
            i += 1
    parts.append("".join(literal))
    return [p for p in parts if not (isinstance(p, str) and p == "")]


def _closing_brace(text: str, start: int) -> int:
    depth, i, quote = 1, start, False
    while i < len(text):
        char = text[i]
        if quote:
            if char == "\\":
                i += 1
            elif char == '"':
                quote = False
        elif char == '"':
            quote = True
        elif char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    raise HclError(f"unterminated interpolation in template: {text[start - 2 : start + 40]!r}")
