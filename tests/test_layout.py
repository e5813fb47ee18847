"""The package's layout: sub-packages by concern, each importing only the ones its `__init__` names.

Data flows text -> tokenizer and batches -> model -> step -> run loop -> checkpoints -> decoder -> text. Each
sub-package's `__init__.py` ends its docstring with a line "May import: a, b, c." naming the sub-packages and
top-level modules it may use; this test holds the code to those lines, so a reader learns the rules from the folder
itself. Beside them: decoding and serving never import training, the model imports no data and no training, no
two sub-packages import each other, and no modules of one sub-package import each other in a circle.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "jax_transformer"
# The modules at the package's top: what every layer may need (errors, files written whole, token checks, how
# programs compile). Everything else lives in a sub-package.
TOP = ("errors", "files", "checks", "compilation")


def _sub_packages() -> list[str]:
    return sorted(p.parent.name for p in PACKAGE.glob("*/__init__.py"))


def _allowed(package: str) -> set[str] | None:
    """The names on the "May import:" line of `package`'s docstring; None for "anything of the package"."""
    doc = ast.get_docstring(ast.parse((PACKAGE / package / "__init__.py").read_text(encoding="utf-8"))) or ""
    found = re.search(r"^May import: (.*?)\.?$", doc, re.M)
    assert found, f"jax_transformer/{package}/__init__.py: its docstring needs a line 'May import: ...'"
    text = found.group(1)
    if text.startswith("anything"):
        return None
    return {name.strip() for name in text.split(",") if name.strip()}


def _imports(path: Path, package: str = "jax_transformer", depth: int = 1) -> set[str]:
    """The names under `package` (dotted) that `path` imports, `depth` parts deep, at any depth of the code (inside
    functions too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == package:
                found.update(alias.name for alias in node.names)
            elif node.module.startswith(package + "."):
                parts = node.module[len(package) + 1 :].split(".")
                if len(parts) >= depth:
                    found.add(".".join(parts[:depth]))
                else:
                    found.update(".".join([*parts, alias.name]) for alias in node.names)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(package + "."):
                    found.add(".".join(alias.name[len(package) + 1 :].split(".")[:depth]))
    return found


def _unit_of(path: Path) -> str:
    """The sub-package of a module, or the top-level module's own name."""
    relative = path.relative_to(PACKAGE)
    return relative.parts[0] if len(relative.parts) > 1 else path.stem


def _uses() -> dict[str, set[str]]:
    """Each sub-package and top-level module -> the other ones its modules import."""
    uses: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        unit = _unit_of(path)
        uses.setdefault(unit, set()).update(_imports(path) - {unit, "__init__"})
    return uses


def test_only_a_few_modules_at_the_top():
    modules = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__")
    assert modules == sorted(TOP), f"put these in a sub-package: {sorted(set(modules) - set(TOP))}"


def test_each_sub_package_imports_only_what_its_init_names():
    uses, known = _uses(), set(_sub_packages()) | set(TOP)
    wrong = []
    for package in _sub_packages():
        allowed = _allowed(package)
        assert allowed is None or allowed <= known, f"{package}: 'May import' names {sorted(allowed - known)}"
        if allowed is not None:
            wrong += [f"{package} imports {other}" for other in sorted(uses.get(package, set()) - allowed)]
    assert not wrong, "imports its __init__ does not allow:\n" + "\n".join(wrong)


def test_the_top_modules_layer_among_themselves():
    """errors < files < settings < compilation < checks: a top module imports only those before it."""
    order = ["errors", "files", "settings", "compilation", "checks"]
    uses = _uses()
    for i, name in enumerate(order):
        assert uses.get(name, set()) <= set(order[:i]), f"{name} imports {sorted(uses[name] - set(order[:i]))}"


@pytest.mark.parametrize(
    "package, never",
    [
        ("decoding", {"training", "serving", "interop", "cli"}),
        ("serving", {"training", "interop", "cli"}),
        ("model", {"data", "training", "checkpoint", "decoding"}),
        ("checkpoint", {"training", "decoding"}),
        ("settings", {"model", "data", "training", "decoding", "checks", "compilation"}),
    ],
)
def test_the_rules_between_concerns(package, never):
    """What the docs promise, stated apart from the __init__ lines so that widening one is a visible change."""
    assert not _uses().get(package, set()) & never


def test_no_two_sub_packages_import_each_other():
    uses = _uses()
    both = sorted({tuple(sorted((a, b))) for a in uses for b in uses[a] if a in uses.get(b, set()) and a != b})
    assert not both, f"sub-packages importing each other: {both}"


def _cycles(folder: Path, package: str) -> list[list[str]]:
    """Import cycles among the modules of `folder` (imports inside functions count: they are cycles a reader
    follows all the same)."""
    modules = {p.stem: p for p in folder.glob("*.py") if p.stem != "__init__"}
    graph = {name: sorted(_imports(path, package) & set(modules) - {name}) for name, path in modules.items()}
    found, state = [], {}

    def visit(name: str, stack: list[str]) -> None:
        state[name] = "open"
        stack.append(name)
        for other in graph[name]:
            if state.get(other) == "open":
                found.append(stack[stack.index(other) :] + [other])
            elif other not in state:
                visit(other, stack)
        stack.pop()
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [])
    return found


@pytest.mark.parametrize(
    "folder, package",
    [("jax_transformer", "jax_transformer")]
    + [(f"jax_transformer/{p}", f"jax_transformer.{p}") for p in _sub_packages()]
    + [("benchmarks", "benchmarks"), ("tests/helpers", "tests.helpers")],
)
def test_no_import_cycles(folder, package):
    """Modules of one sub-package may import each other, but never in a circle; the benchmark's sections share
    benchmarks/common.py instead of importing their command line back."""
    cycles = _cycles(PACKAGE.parent / folder, package)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_cycle_check_can_fail(tmp_path):
    (tmp_path / "a.py").write_text("from pkg import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from pkg.a import x\n")
    assert _cycles(tmp_path, "pkg") == [["a", "b", "a"]]


def test_the_rule_check_can_fail(tmp_path, monkeypatch):
    """A module of `model` that imports training is caught."""
    fake = tmp_path / "jax_transformer"
    (fake / "model").mkdir(parents=True)
    (fake / "model" / "__init__.py").write_text('"""The model.\n\nMay import: settings.\n"""\n')
    (fake / "model" / "bad.py").write_text("from jax_transformer.training import run\n")
    monkeypatch.setitem(globals(), "PACKAGE", fake)  # the module global the readers above use
    assert _uses()["model"] == {"training"} and _allowed("model") == {"settings"}
