"""No import cycles among dresd's modules, imports inside functions included.

A cycle hidden behind an import inside a function still ties the modules together: neither can
be read, tested or moved without the other. The graph is read from the source with `ast`, so
the test imports nothing. An edge is every module an `import` statement runs: the named module
and each package above it (its `__init__` runs first), except the importing module's own
packages, which are already being imported. Imports under `if TYPE_CHECKING:` never run and do
not count.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src"


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    """Every dresd module by dotted name."""
    return {module_name(path): path for path in sorted((SRC / "dresd").rglob("*.py"))}


def is_type_checking_block(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def imported_names(tree: ast.AST, package: str) -> set[str]:
    """Dotted names of what the module's import statements import (anywhere in the module,
    except under `if TYPE_CHECKING:`): for `from a import b`, both `a` and `a.b` (`b` may be
    a module or a name in `a`; the caller keeps what is a module)."""
    names: set[str] = set()

    def visit(node: ast.AST) -> None:
        if is_type_checking_block(node):
            return
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the importing module's package
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            names.add(origin)
            names.update(f"{origin}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return names


def ancestors(name: str) -> list[str]:
    """`a.b.c` -> [`a`, `a.b`]."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def import_graph() -> dict[str, set[str]]:
    """module -> the dresd modules importing it runs."""
    found = modules()
    graph: dict[str, set[str]] = {}
    for name, path in found.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        own_packages = set(ancestors(name)) | {name}
        edges: set[str] = set()
        for imported in imported_names(ast.parse(path.read_text()), package):
            for target in [*ancestors(imported), imported]:
                if target in found and target not in own_packages:
                    edges.add(target)
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None (depth-first search, three colours)."""
    state: dict[str, str] = {}  # "open" while on the current path, "done" once explored
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for child in sorted(graph[node]):
            if state.get(child) == "open":
                return path[path.index(child):] + [child]
            if child not in state and (cycle := visit(child)):
                return cycle
        path.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_graph_sees_imports_inside_functions_and_the_packages_above():
    tree = ast.parse("def f():\n    from dresd.a.b import c\n")
    assert imported_names(tree, "dresd.x") == {"dresd.a.b", "dresd.a.b.c"}
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


@pytest.fixture(scope="module")
def imported_in_turn() -> dict:
    """One fresh interpreter imports, in turn, the loop (`dresd.decoding`) and the serve command
    (its modules, its options parsed without --ray); {step: the modules loaded after it}, and
    the parsed `ray` option. One process for both tests below (each start loads torch, ~4 s
    here); a step only adds modules, so what is missing after the serve command's step was
    never imported by it."""
    code = (
        "import json, sys\n"
        "seen = {}\n"
        "import dresd.decoding\n"
        "seen['loop'] = sorted(sys.modules)\n"
        "from dresd.cli.main import build_parser\n"
        "import dresd.cli.serve, dresd.serve.app, dresd.serve.auth\n"
        "args = build_parser().parse_args(['serve', '--api-key', 'k', '--replicas', '2'])\n"
        "seen['serve'] = sorted(sys.modules)\n"
        "seen['ray_option'] = args.ray\n"
        "print(json.dumps(seen))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.subprocess
def test_importing_the_loop_imports_no_drafter(imported_in_turn):
    """`dresd.decoding` holds the drafter interface; the drafters depend on it, not the other
    way round."""
    assert [m for m in imported_in_turn["loop"] if m.startswith("dresd.drafters")] == []


@pytest.mark.subprocess
def test_the_serve_command_does_not_import_ray(imported_in_turn):
    """Without --ray, Ray is never imported: the command's modules and its options parsed
    (moved here from test_serve_auth.py, to share the interpreter above)."""
    assert imported_in_turn["ray_option"] is None
    serve = imported_in_turn["serve"]
    assert "ray" not in serve, sorted(m for m in serve if "ray" in m)
