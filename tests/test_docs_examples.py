"""Every Python example of README.md and docs/ is Python, and every import in it resolves: the paths the pages
teach are the package's paths. (What the examples do is tested where it is built: the front door's in
test_translator.py, the model's in the parity tests.)"""

from __future__ import annotations

import ast
import importlib
import re
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
BLOCK = re.compile(r"^([ \t]*)```python\n(.*?)^\1```", re.M | re.S)
# Other libraries' examples (peft and transformers loading this project's exports) need only their own imports.
OPTIONAL = ("peft", "transformers", "ctranslate2", "libretranslatepy")


def _blocks() -> list[tuple[str, str]]:
    found = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for match in BLOCK.finditer(text):
            line = text[: match.start()].count("\n") + 1
            found.append((f"{page.relative_to(REPO)}:{line}", textwrap.dedent(match.group(2))))
    return found


BLOCKS = _blocks()


def test_the_pages_have_examples():
    assert len(BLOCKS) >= 8 and any("Translator" in code for _, code in BLOCKS)


@pytest.mark.parametrize("where, code", BLOCKS, ids=[where for where, _ in BLOCKS])
def test_an_example_is_python_and_its_imports_resolve(where, code):
    tree = ast.parse(code, filename=where)  # a SyntaxError names the page and line
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if not alias.name.startswith(OPTIONAL):
                    importlib.import_module(alias.name)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.module.startswith(OPTIONAL):
            module = importlib.import_module(node.module)
            for alias in node.names:
                if not hasattr(module, alias.name):
                    importlib.import_module(f"{node.module}.{alias.name}")  # a sub-module, else ImportError
