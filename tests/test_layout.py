"""The package layout holds: imports go one way (import-linter, and an independent cycle check over
every import statement), few top-level modules, no long function, the README's map is the tree."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("theanompi", "prep")
MAX_TOP_MODULES = 8
MAX_FUNCTION_LINES = 100


def _sources() -> Iterator[tuple[Path, ast.Module]]:
    for top in PACKAGES:
        for path in sorted((REPO / top).rglob("*.py")):
            yield path, ast.parse(path.read_text(), str(path))


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def part_of(module: str) -> str | None:
    """A part: one subpackage or top-level module of theanompi, or prep (None: outside)."""
    bits = module.split(".")
    if bits[0] == "prep":
        return "prep"
    if bits[0] != "theanompi" or len(bits) == 1:
        return None
    return f"theanompi.{bits[1]}"


def imported_modules(path: Path, tree: ast.Module) -> Iterator[str]:
    """Every module an ``import`` statement of the file names, inside functions too."""
    here = _module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            yield base
            yield from (f"{base}.{a.name}" for a in node.names)  # a submodule, if it is one


def _is_part(part: str) -> bool:
    """``from theanompi import __version__`` names no part; ``from theanompi import io`` does."""
    path = REPO / part.replace(".", "/")
    return (path / "__init__.py").exists() or path.with_suffix(".py").exists()


def part_graph() -> dict[str, set[str]]:
    """part -> the other parts its modules import."""
    edges: dict[str, set[str]] = {}
    for path, tree in _sources():
        src = part_of(_module_name(path))
        for target in imported_modules(path, tree):
            dst = part_of(target)
            if src and dst and dst != src and _is_part(dst):
                edges.setdefault(src, set()).add(dst)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one part (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(set(edges) | {w for ws in edges.values() for w in ws}):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_between_parts() -> None:
    edges = part_graph()
    assert edges["theanompi.cli"] >= {"theanompi.train", "prep"}  # the graph is really read
    assert cycles(edges) == []


def test_the_cycle_check_can_fail() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_import_linter_contracts_are_kept() -> None:
    lint = Path(sys.executable).with_name("lint-imports")
    out = subprocess.run([str(lint)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "0 broken" in out.stdout


def test_few_top_level_modules_and_every_part_says_what_it_holds() -> None:
    top = sorted(p.name for p in (REPO / "theanompi").glob("*.py") if p.name != "__init__.py")
    assert len(top) <= MAX_TOP_MODULES, top
    for init in sorted((REPO / "theanompi").glob("*/__init__.py")):
        assert ast.get_docstring(ast.parse(init.read_text())), f"{init} has no docstring"


def test_no_function_over_100_lines() -> None:
    long = [
        f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1})"
        for path, tree in _sources()
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert long == []


def test_the_readme_layout_section_is_the_tree() -> None:
    text = (REPO / "README.md").read_text()
    section = text.split("\n## Layout", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"^\| `((?:theanompi|prep)/[\w/.]*)`", section, re.M))
    tree = {"prep/"} | {
        f"theanompi/{p.name}/" if p.is_dir() else f"theanompi/{p.name}"
        for p in (REPO / "theanompi").iterdir()
        if (p.is_dir() and (p / "__init__.py").exists()) or (p.suffix == ".py")
    }
    assert named == tree
