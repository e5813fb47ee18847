"""train.py as people use it: bad input, help, stopping on NaN, signals, and the PyTorch round trip."""

from __future__ import annotations

import json
import signal
import sys

import jax
import numpy as np
import pytest

from jax_transformer.checkpoint import manager as ckpt_lib
from jax_transformer.settings.config import LoopConfig
from jax_transformer.training import loop as loop_lib
from jax_transformer.training import run as run_lib
from jax_transformer.training import trainer
from tests.helpers.training import (
    REPO,
    completed_steps,
    logged_steps,
    run_main,
    start_train_process,
    tiny_train_args,
    wait_for,
    write_corpus,
)
from tests.helpers.twins import flat

# --- bad input: a clean message naming the file and line, exit code 1, no traceback ----------------------------


def _write(path, text: str | bytes):
    path.write_bytes(text if isinstance(text, bytes) else text.encode("utf-8"))
    return str(path)


BAD_INPUTS = {
    # name: (files to write {name: content}, extra flags, expected pieces of the message)
    "missing file": ({}, ["--src", "{d}/nope.de", "--tgt", "{d}/nope.en"], ["nope.de", "file not found"]),
    "line counts differ": (
        {"a.de": "eins\nzwei\ndrei\n", "a.en": "one\ntwo\n"},
        ["--src", "{d}/a.de", "--tgt", "{d}/a.en"],
        ["a.de has 3 lines", "a.en has 2", "line 3"],
    ),
    "empty line as error": (
        {"a.de": "eins\n\ndrei\n", "a.en": "one\ntwo\nthree\n"},
        ["--src", "{d}/a.de", "--tgt", "{d}/a.en", "--on-empty", "error"],
        ["a.de, line 2", "empty source line"],
    ),
    "too long as error": (
        {"a.tsv": "eins\tone\n" + "zwei " * 40 + "\ttwo\n"},
        ["--tsv", "{d}/a.tsv", "--on-too-long", "error", "--max-len", "16", "--vocab-size", "30"],
        ["a.tsv, line 2", "too long for max_len=16"],
    ),
    "tsv without tab": (
        {"a.tsv": "eins\tone\nzwei two\n"},
        ["--tsv", "{d}/a.tsv"],
        ["a.tsv, line 2", "expected exactly one tab"],
    ),
    "invalid utf-8": (
        {"a.de": b"eins\nzw\xffei\n", "a.en": b"one\ntwo\n"},
        ["--src", "{d}/a.de", "--tgt", "{d}/a.en"],
        ["a.de, line 2", "not valid UTF-8"],
    ),
    "source without target": ({"a.de": "eins\n"}, ["--src", "{d}/a.de"], ["source file was given without its target"]),
    "bad validation file": (
        {"a.tsv": "eins\tone\n", "v.tsv": "no tab here\n"},
        ["--tsv", "{d}/a.tsv", "--valid-tsv", "{d}/v.tsv"],
        ["v.tsv, line 1", "expected exactly one tab"],
    ),
    "bad model field value": (
        {"a.tsv": "eins\tone\nzwei\ttwo\n"},
        ["--tsv", "{d}/a.tsv", "--d-model", "30", "--num-heads", "4", "--vocab-size", "30"],
        ["'d_model' (30) must be divisible by 'num_heads' (4)"],
    ),
    "pair longer than the packed rows": (
        {"a.tsv": "a\tb\nzwei drei vier\ttwo three four\n"},
        ["--tsv", "{d}/a.tsv", "--pack-length", "6", "--vocab-size", "30"],
        ["a.tsv, line 2: pair needs", "more than pack_length=6", "leave pack_length out"],
    ),
    "bad pack length": (
        {"a.tsv": "eins\tone\n"},
        ["--tsv", "{d}/a.tsv", "--pack-length", "1"],
        ["'pack_length' must be an int >= 2"],
    ),
    "pack length without packing": (
        {"a.tsv": "eins\tone\n"},
        ["--tsv", "{d}/a.tsv", "--batching", "buckets", "--pack-length", "16"],
        ["'pack_length' (16) needs batching='packed'"],
    ),
    "bad profile": (
        {"a.tsv": "eins\tone\n"},
        ["--tsv", "{d}/a.tsv", "--profile", "5:2"],
        ["loop field 'profile' must be START:STOP", "'5:2'"],
    ),
    "bad profile form": (
        {"a.tsv": "eins\tone\n"},
        ["--tsv", "{d}/a.tsv", "--profile", "7"],
        ["loop field 'profile' must be START:STOP", "'7'"],
    ),
    "empty compilation cache": (
        {"a.tsv": "eins\tone\n"},
        ["--tsv", "{d}/a.tsv", "--compilation-cache", " "],
        ["'compilation_cache' must be a folder or 'off'"],
    ),
    "bad loop value": (
        {"a.tsv": "eins\tone\nzwei\ttwo\n"},
        ["--tsv", "{d}/a.tsv", "--eval-every", "0"],
        ["loop field 'eval_every' must be an int >= 1, got 0"],
    ),
}


FLAG_VALUES = ("bad pack length", "bad loop value")  # refused as the flags are parsed


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_reported_cleanly(tmp_path, case):
    files, flags, expected = BAD_INPUTS[case]
    for name, content in files.items():
        _write(tmp_path / name, content)
    flags = [f.format(d=tmp_path) for f in flags]
    code, out, err = run_main(["train", *flags, "--run-dir", str(tmp_path / "run"), "--no-progress"])
    if case in FLAG_VALUES:  # a value out of its flag's range: argparse's exit 2, naming the flag
        assert code == 2 and err.splitlines()[-1].startswith("train.py train: error: argument --"), out + err
    else:
        assert code == 1 and err.startswith("error: "), out + err
    for piece in expected:
        assert piece in err, f"{piece!r} not in {err!r}"
    assert "Traceback" not in err + out


def test_help_explains_every_flag():
    sys.path.insert(0, str(REPO))
    from jax_transformer.cli import main as cli

    sys.path.remove(str(REPO))
    parser = cli.build_parser()
    commands = parser._subparsers._group_actions[0].choices
    assert set(commands) == set(cli.COMMANDS)
    for name, sub in commands.items():
        for action in sub._actions:
            if action.option_strings and action.dest != "help":
                assert action.help and len(action.help) > 10, f"{name} {action.option_strings} has no help"
    train_flags = {s for a in commands["train"]._actions for s in a.option_strings}
    for flag in (
        "--src",
        "--tgt",
        "--tsv",
        "--valid-src",
        "--valid-tgt",
        "--valid-tsv",
        "--on-empty",
        "--on-too-long",
        "--preset",
        "--d-model",
        "--num-encoder-layers",
        "--norm-first",
        "--label-smoothing",
        "--lr-scale",
        "--warmup-steps",
        "--warmup",
        "--clip-norm",
        "--weight-decay",
        "--resume",
        "--init-from-torch",
        "--max-minutes",
        "--steps",
        "--batching",
        "--pack-length",
        "--compilation-cache",
        "--compile-ahead",
        "--profile",
    ):
        assert flag in train_flags


# --- divergence -------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_nan_loss_stops_without_overwriting_the_last_good_checkpoint(tmp_path):
    """Steps 1-4 are real, with checkpoints at 2 and 4; from step 5 on the step reports a NaN loss and poisons
    the parameters (what a diverged update does). The run must stop with a TrainingError naming step 5, save
    nothing, leave checkpoint 4 as it was, and log steps 1-4 and the error of step 5. The loop dispatches steps
    without waiting for their losses, but checks them before any save, so step 6 may have been dispatched."""
    from jax_transformer.data.tokenizer import Tokenizer
    from tests.helpers.batches import unit_batch
    from tests.helpers.configs import unit_config, unit_optim

    class Batches:  # stands in for a BatchStream: the unit-test batches, so the compiled step is shared
        index = 0

        def __next__(self):
            self.index += 1
            return unit_batch(self.index)

        def state(self):
            return {"epoch": 0, "index": self.index, "batches_per_epoch": 1000}

    tokenizer = Tokenizer.train([f"w{i} v{i % 7}" for i in range(200)], 40, model_type="bpe")
    config, optim = unit_config(), unit_optim()
    manager = ckpt_lib.CheckpointManager(tmp_path / "run" / "checkpoints")
    run = loop_lib.Run(
        config=config,
        optim=optim,
        tokenizer=tokenizer,
        stream=Batches(),
        state=trainer.create_train_state(config, optim),
        loop=LoopConfig(steps=10, save_every=2, progress=False),
        run_dir=tmp_path / "run",
        checkpoints=manager,
        print=lambda s: None,
    )
    real_step, calls, saved = run.train_step, [], {}

    def diverging_step(state, batch):
        calls.append(1)
        state, sums = real_step(state, batch)
        if len(calls) == 4:
            saved.update(flat(jax.device_get(state.params)))  # what checkpoint 4 must hold
        if len(calls) >= 5:
            state = state.replace(params=jax.tree_util.tree_map(lambda p: p * np.nan, state.params))
            sums = dict(sums, loss=sums["loss"] * np.nan)
        return state, sums

    run.train_step = diverging_step
    with pytest.raises(
        loop_lib.TrainingError,
        match=r"step 5: the training loss is nan .* last good checkpoint "
        r"is step 4",
    ):
        loop_lib.train_loop(run)
    manager.close()
    assert len(calls) in (5, 6) and completed_steps(tmp_path / "run") == [2, 4]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    logged = [(r["step"], "error" in r) for r in records if r["kind"] == "train"]
    assert logged == [(1, False), (2, False), (3, False), (4, False), (5, True)]
    restored = ckpt_lib.load(tmp_path / "run", "latest")
    assert restored.step == 4
    params = flat(restored.params)
    assert params.keys() == saved.keys()
    assert all(np.array_equal(params[k], saved[k]) for k in saved)


def test_training_error_exits_with_code_3(monkeypatch, tmp_path):
    def diverge(run):
        raise loop_lib.TrainingError("step 7: the training loss is nan (not finite)")

    monkeypatch.setattr(run_lib, "train_loop", diverge)
    code, out, err = run_main(tiny_train_args(tmp_path / "run", write_corpus(tmp_path), steps=10))
    assert code == 3 and "error: step 7: the training loss is nan" in err and "Traceback" not in err


# --- kill -9 and SIGTERM ----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_kill_9_leaves_the_last_checkpoint_loadable_and_sigterm_saves(tmp_path):
    """1. train.py saving every 2 steps is SIGKILLed as soon as a first checkpoint is complete (orbax writes each
    step into a temporary folder and renames it when done; the poll waits for that name, not for time). The last
    complete checkpoint loads. 2. A resume of that run gets SIGTERM after a few more steps: it saves the step it
    reached and exits with 128 + 15."""
    train = write_corpus(tmp_path)
    run, cache = tmp_path / "run", tmp_path / "xla-cache"
    log = tmp_path / "first.log"
    process = start_train_process(tiny_train_args(run, train, steps=100000, save_every=2), log, cache)
    try:
        wait_for(lambda: len(completed_steps(run)) >= 1, process, log)
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=60)
    finally:
        process.kill()
    assert process.returncode == -signal.SIGKILL
    steps = completed_steps(run)
    loaded = ckpt_lib.load(run, "latest")
    assert loaded.step == max(steps) and loaded.step % 2 == 0
    assert all(np.isfinite(v).all() for v in flat(loaded.params).values())
    assert loaded.data_state["index"] == loaded.step % loaded.data_state["batches_per_epoch"]

    log = tmp_path / "second.log"
    process = start_train_process(
        ["train", "--resume", str(run), "--steps", "100000", "--save-every", "100000", "--no-progress"], log, cache
    )
    try:
        # Until the resumed run has trimmed the log to its checkpoint (before "compiling") and logged 3 more steps:
        # the killed run may have logged steps past its last complete checkpoint.
        wait_for(lambda: "compiling" in log.read_text() and logged_steps(run) >= loaded.step + 3, process, log)
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=120)
    finally:
        process.kill()
    text = log.read_text()
    assert process.returncode == 128 + signal.SIGTERM, text[-2000:]
    assert "stopped by SIGTERM" in text and "Traceback" not in text
    after = ckpt_lib.load(run, "latest")
    assert after.step > loaded.step + 2  # the step reached when the signal came, not an older one
    assert after.step == logged_steps(run)


# --- PyTorch export and import ----------------------------------------------------------------------------------


def _logits_both(params, config, torch_state, batch):
    """Flax logits from `params` and torch_reference logits from `torch_state` on the same batch."""
    import torch

    import torch_reference
    from jax_transformer.model.transformer import Transformer

    jax.config.update("jax_default_matmul_precision", "highest")
    flax_logits = np.asarray(Transformer(config).apply({"params": params}, batch["src"], batch["tgt_in"]))
    model = torch_reference.Transformer(config).eval()
    model.load_state_dict(torch_state, strict=True)
    with torch.no_grad():
        torch_logits = model(
            torch.from_numpy(batch["src"].astype(np.int64)), torch.from_numpy(batch["tgt_in"].astype(np.int64))
        ).numpy()
    return flax_logits, torch_logits


@pytest.mark.slow
def test_export_and_import_round_trip(tmp_path):
    """export writes a file torch_reference loads and that gives the Flax logits; --init-from-torch starts a run
    from such a file (and from a bare torch_reference state_dict) with exactly those weights.

    Logit tolerance 1e-5 absolute: the same float32 model in two frameworks differs only in summation order
    (see parity_tests/test_forward_parity.py, which measures ~1e-6)."""
    import torch

    import torch_reference
    from jax_transformer.data.batching import BatchStream, encode_corpus
    from jax_transformer.data.corpus import read_tsv

    train = write_corpus(tmp_path)
    code, out, err = run_main(tiny_train_args(tmp_path / "run", train, steps=3))
    assert code == 0, out + err
    exported = tmp_path / "model.pt"
    code, out, err = run_main(["export", "--checkpoint", str(tmp_path / "run"), "--output", str(exported)])
    assert code == 0, out + err

    payload = torch.load(exported, weights_only=True)
    loaded = ckpt_lib.load(tmp_path / "run", "latest")
    assert payload["config"] == loaded.config.to_json() and payload["tokenizer"] == loaded.tokenizer.to_bytes()
    batch = next(BatchStream(encode_corpus(read_tsv(train), loaded.tokenizer, loaded.config.max_len), 256))
    flax_logits, torch_logits = _logits_both(loaded.params, loaded.config, payload["state_dict"], batch)
    assert np.max(np.abs(flax_logits - torch_logits)) <= 1e-5

    # Back: a run started from the exported file holds exactly those weights (step 0 is saved as is).
    code, out, err = run_main(
        [
            "train",
            "--tsv",
            str(train),
            "--init-from-torch",
            str(exported),
            "--steps",
            "0",
            "--run-dir",
            str(tmp_path / "from_torch"),
            "--no-progress",
            "--max-tokens",
            "512",
        ]
    )
    assert code == 0, out + err
    started = ckpt_lib.load(tmp_path / "from_torch", "latest")
    assert started.step == 0 and started.config == loaded.config
    assert started.tokenizer.to_bytes() == loaded.tokenizer.to_bytes()  # the file's vocabulary, not a new one
    before, after = flat(loaded.params), flat(started.params)
    assert before.keys() == after.keys() and all(np.array_equal(before[k], after[k]) for k in before)

    # The same through safetensors (no pickle): `export --format safetensors`, read back by --init-from-torch.
    import safetensors.torch

    safe = tmp_path / "model.weights"
    code, out, err = run_main(
        ["export", "--checkpoint", str(tmp_path / "run"), "--output", str(safe), "--format", "safetensors"]
    )
    assert code == 0, out + err
    flax_logits, torch_logits = _logits_both(loaded.params, loaded.config, safetensors.torch.load_file(safe), batch)
    assert np.max(np.abs(flax_logits - torch_logits)) <= 1e-5
    code, out, err = run_main(
        [
            "train",
            "--tsv",
            str(train),
            "--init-from-torch",
            str(safe),
            "--steps",
            "0",
            "--run-dir",
            str(tmp_path / "from_safe"),
            "--no-progress",
            "--max-tokens",
            "512",
        ]
    )
    assert code == 0, out + err
    after = flat(ckpt_lib.load(tmp_path / "from_safe", "latest").params)
    assert before.keys() == after.keys() and all(np.array_equal(before[k], after[k]) for k in before)

    # A bare state_dict of a freshly initialised PyTorch model, described by flags.
    torch.manual_seed(0)
    model = torch_reference.Transformer(loaded.config)
    bare = tmp_path / "bare.pt"
    torch.save(model.state_dict(), bare)
    code, out, err = run_main(
        tiny_train_args(tmp_path / "from_bare", train, steps=0, extra=("--init-from-torch", str(bare)))
    )
    assert code == 0, out + err
    started = ckpt_lib.load(tmp_path / "from_bare", "latest")
    flax_logits, torch_logits = _logits_both(started.params, started.config, model.state_dict(), batch)
    assert np.max(np.abs(flax_logits - torch_logits)) <= 1e-5

    # A file whose model does not fit the flags: the mismatching field is named.
    code, out, err = run_main(
        tiny_train_args(tmp_path / "bad", train, steps=0, extra=("--init-from-torch", str(exported), "--d-model", "64"))
    )
    assert code == 1 and "'d_model'" in err and "Traceback" not in err
