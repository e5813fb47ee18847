"""Fixtures shared by the test modules of tests/: one tiny trained run for every test that reads a checkpoint
without changing it (a test that changes it copies it first)."""

from __future__ import annotations

import pytest

from tests.helpers.training import run_main, tiny_train_args, write_corpus


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """A tiny run (tests.helpers.training's one-layer model) trained 2 steps on the numbers corpus, with that corpus
    as validation data: (run directory, corpus TSV). Read it; copy it (shutil.copytree) to change it."""
    root = tmp_path_factory.mktemp("tiny_run")
    corpus = write_corpus(root)
    run = root / "run"
    code, out, err = run_main(tiny_train_args(run, corpus, steps=2, valid=corpus))
    assert code == 0, out + err
    return run, corpus
