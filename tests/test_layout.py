"""The package's layering: each module of `jax_transformer` imports only modules before it in `LAYERS`.

Data flows text -> tokenizer and batches -> model -> step -> run loop -> checkpoints -> decoder -> text, and imports
go one way, downwards: the checkpoint module never imports the loop, the step never imports the loop, the
decoder never imports training. A new module must be placed in `LAYERS` (the test fails until it is), which is
where a reader learns what it may use.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "jax_transformer"

# Lowest first. Modules on one line form one layer and may import each other.
LAYERS = [
    ("errors",),  # the errors a user can cause
    ("files",),  # files written whole or not at all
    ("config",),  # every setting: the dataclasses, their validation, recipes and `resolve`; no jax, no torch
    ("compilation",),  # how programs compile: exact rounding in bfloat16, the persistent cache and the decoders
    # stored as traced, compiling ahead
    ("host_memory",),  # malloc keeps what a program frees on a CPU (glibc), set before jax starts its threads
    ("positions", "masks", "checks"),  # checks: token ids and shapes at the entry points
    ("corpus", "tokenizer"),  # text in: reading files (file:line errors); the joint SentencePiece model
    ("batching", "default_task"),  # ids and batches (packed rows or length buckets); the built-in task's pairs
    ("token_arrays",),  # training files encoded once into memory-mapped token arrays (the corpus cache)
    ("dropout", "losses"),
    ("quantization",),  # int8 weights with qwix, and the products that read them
    ("model",),
    ("port",),  # numpy-only weight map
    ("pretrained",),  # Marian, FSMT, fairseq, M2M-100 (NLLB) and mBART configs and weight maps (numpy only)
    ("finetuning",),  # what a fine-tuning run trains: LoRA adapters (on an int8 base: QLoRA), frozen parameters;
    # the adapters in peft's names
    ("sharding",),  # the mesh's axes (data, fsdp, tensor) and where each array of a train state lives on it
    ("training",),  # optimiser, train state, train/eval steps: the twin of torch_reference/training.py
    ("plan",),  # the memory a training step needs per device, compiled ahead from abstract shapes
    ("search",),  # the one search loop over the model's cache, its rules as strategies (this project's, transformers')
    ("schedule",),  # how a batch runs through the search's programs: whole, or the CPU's throughput schedule
    ("decoding",),  # the decoders callers use: greedy and beam search, generate, a run's decoder
    ("translation",),  # text in, text out: batches of a few shapes, decoded by the model's rules
    ("documents",),  # documents in: sentences split with the layout kept, streamed in bounded memory
    ("scoring",),  # the log-probs of given translations (teacher forcing), for filtering and reranking
    ("evaluation", "visualize"),
    ("checkpoint",),
    ("export",),  # PyTorch / safetensors weight files
    ("distributed",),  # devices and processes: where state and batches live, jax.distributed, agreeing to stop
    ("averaging", "verify"),  # checkpoint averaging; a trained checkpoint against its PyTorch twin (via export)
    ("hub",),  # pretrained models' files: import them as run directories, export them back
    ("loop",),  # the training loop
    ("run",),  # setting up a run
    ("inference",),  # a model loaded to decode (checkpoint, dtype, int8, mesh, languages), its decoding resolved
    ("service",),  # train.py serve: HTTP (LibreTranslate's API, a native one), requests batched for the decoders
]


def _layer_of() -> dict[str, int]:
    return {name: i for i, names in enumerate(LAYERS) for name in names}


def _imports(path: Path, package: str = "jax_transformer") -> set[str]:
    """Modules of `package` (a dotted name) that `path` imports, at any depth (inside functions too)."""
    found = set()
    depth = package.count(".") + 1
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == package:
                found.update(alias.name for alias in node.names)
            elif node.module.startswith(package + "."):
                found.add(node.module.split(".")[depth])
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[depth] for a in node.names if a.name.startswith(package + "."))
    return found


def test_every_module_has_a_layer():
    modules = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__"}
    assert modules == set(_layer_of()), f"place these in LAYERS: {sorted(modules - set(_layer_of()))}"


def test_imports_go_downwards_only():
    layer = _layer_of()
    upward = []
    for path in sorted(PACKAGE.glob("*.py")):
        if path.stem == "__init__":
            continue
        for imported in _imports(path):
            if imported in layer and layer[imported] > layer[path.stem]:
                upward.append(f"{path.stem} (layer {layer[path.stem]}) imports {imported} (layer {layer[imported]})")
    assert not upward, "imports against the flow:\n" + "\n".join(upward)


def test_the_checkpoint_module_knows_neither_loop_nor_optimiser():
    assert not {"loop", "run", "training"} & _imports(PACKAGE / "checkpoint.py")


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
    [("jax_transformer", "jax_transformer"), ("benchmarks", "benchmarks"), ("tests/helpers", "tests.helpers")],
)
def test_no_import_cycles(folder, package):
    """Modules of one layer may import each other, but never in a circle; the benchmark's sections share
    benchmarks/common.py instead of importing their command line back."""
    cycles = _cycles(PACKAGE.parent / folder, package)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_cycle_check_can_fail(tmp_path):
    (tmp_path / "a.py").write_text("from pkg import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from pkg.a import x\n")
    assert _cycles(tmp_path, "pkg") == [["a", "b", "a"]]
