"""Models by their hub name (`import ORG/NAME [--revision R]`), through huggingface_hub: here its cache, laid out as
huggingface_hub lays it out (models--ORG--NAME/refs, snapshots/<commit>/ linking into blobs/), with HF_HUB_OFFLINE=1,
since these machines have no network."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from jax_transformer.checkpoint import manager as checkpoint
from jax_transformer.model.params import flatten
from tests.helpers.training import run_main

pytest.importorskip("transformers")
pytest.importorskip("huggingface_hub")

NAME = "tiny-org/opus-mt-tiny-en-fr"


def cache_repo(cache: Path, name: str, folder: Path, commit: str, ref: str = "main") -> None:
    """`folder`'s files as revision `commit` of `name` in the hub cache `cache`, `ref` pointing at it: each file a
    blob named by its hash, and the snapshot's entries relative symlinks to the blobs."""
    repo = cache / ("models--" + name.replace("/", "--"))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for path in folder.iterdir():
        data = path.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / path.name)


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory):
    """(cache folder, the model's save_pretrained folder, a second revision's folder): a tiny Marian model as
    revision "aaaa..." (main) and the same with its logits bias moved as revision "bbbb..." (tag v2)."""
    import json

    from tests.helpers.pretrained import marian_tokenizer_files, tiny_marian

    root = tmp_path_factory.mktemp("hub")
    folder = root / "model"
    sizes = marian_tokenizer_files(folder)
    tiny_marian(sizes).save_pretrained(folder)
    second = root / "model-v2"
    shutil.copytree(folder, second)
    config = json.loads((second / "config.json").read_text())
    (second / "config.json").write_text(json.dumps({**config, "dropout": 0.3}))  # a visible difference
    cache = root / "cache"
    cache_repo(cache, NAME, folder, "a" * 40)
    cache_repo(cache, NAME, second, "b" * 40, ref="v2")
    return cache, folder


@pytest.fixture
def offline(hub_cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache[0]))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return hub_cache


def test_a_hub_name_imports_as_its_folder_does(offline, tmp_path):
    cache, folder = offline
    code, out, err = run_main(["import", NAME, "--output", str(tmp_path / "by-name")])
    assert code == 0, out + err
    code, out, err = run_main(["import", str(folder), "--output", str(tmp_path / "by-path")])
    assert code == 0, out + err
    by_name, by_path = (checkpoint.load(tmp_path / name, "best") for name in ("by-name", "by-path"))
    assert by_name.config == by_path.config
    for key, value in flatten(by_path.params).items():
        np.testing.assert_array_equal(flatten(by_name.params)[key], value)
    origin = by_name.run["imported_from"]
    assert origin["source"] == NAME and origin["revision"] == "a" * 40  # the name and commit, not the cache folder


def test_a_revision_picks_its_snapshot(offline, tmp_path):
    code, out, err = run_main(["import", NAME, "--revision", "v2", "--output", str(tmp_path / "v2")])
    assert code == 0, out + err
    loaded = checkpoint.load(tmp_path / "v2", "best")
    assert loaded.config.dropout == 0.3 and loaded.run["imported_from"]["revision"] == "b" * 40


@pytest.mark.parametrize(
    "name, revision",
    [("tiny-org/no-such-model", None), (NAME, "v9")],
)
def test_a_name_not_there_is_an_error_naming_it_and_the_cache(offline, tmp_path, name, revision):
    cache, _ = offline
    args = ["import", name, "--output", str(tmp_path / "run")] + (["--revision", revision] if revision else [])
    code, out, err = run_main(args)
    assert code == 1 and "Traceback" not in err, err
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"error: {name} (revision {revision or 'main'}): no such local path"), line
    assert str(cache) in line and "HF_HUB_OFFLINE=1" in line
    assert not (tmp_path / "run").exists()


def test_a_name_the_hub_refuses_and_a_revision_of_a_path_are_errors(offline, tmp_path):
    _, folder = offline
    code, out, err = run_main(["import", "tiny-org/a--b", "--output", str(tmp_path / "run")])
    assert code == 1 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1].startswith("error: tiny-org/a--b: no such local path, and not a valid hub name")
    code, out, err = run_main(["import", str(folder), "--revision", "v2", "--output", str(tmp_path / "run")])
    assert code == 1 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == f"error: --revision v2 is for a hub name; {folder} is a local path"
    assert not (tmp_path / "run").exists()
