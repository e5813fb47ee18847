"""Faults a person meets at the command line, each an "error: ..." line that names what is at fault (or, for a
closed pipe, a quiet end), never a traceback: flags out of range (every numeric flag of every sub-command, at parse
time), a decoding the model cannot do, a full disk under train, translate and export, a first checkpoint that
could not be saved, an empty step folder, a missing import path. Everything here runs in this process."""

from __future__ import annotations

import argparse
import contextlib
import errno
import io
import math
import os
import shutil
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers.training import REPO, completed_steps, run_main, tiny_train_args, write_corpus

sys.path.insert(0, str(REPO))
from jax_transformer.cli import main as cli  # noqa: E402

sys.path.remove(str(REPO))

# What each sub-command needs besides the flag tried, so that parsing reaches it.
REQUIRED = {
    "evaluate": ["--checkpoint", "RUN"],
    "translate": ["--checkpoint", "RUN"],
    "export": ["--checkpoint", "RUN", "--output", "OUT"],
    "import": ["SOURCE", "--output", "OUT"],
    "attention": ["--checkpoint", "RUN", "--sentence", "S"],
    "average": ["--checkpoint", "RUN", "--last", "2", "--output", "OUT"],
    "verify": ["--checkpoint", "RUN"],
    "plot": ["--runs", "RUN"],
}


def numeric_flags() -> list[tuple[str, str, argparse.Action]]:
    """(sub-command, flag, action) of every flag that takes a number, across every sub-command."""
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    found = []
    for command, p in sub.choices.items():
        for action in p._actions:
            if action.option_strings and action.type is not None and action.type not in (str,):
                if getattr(action.type, "__name__", "") in ("int", "float"):
                    found.append((command, action.option_strings[0], action))
    return found


FLAGS = numeric_flags()


def out_of_range(action: argparse.Action):
    """A strategy of the values the flag must refuse: below its lower bound, at or above its upper one, and (for a
    number) nan and the infinities."""
    low, high = action.type.bounds
    if action.type.__name__ == "int":
        parts = ([st.integers(max_value=math.ceil(low) - 1)] if low is not None else []) + (
            [st.integers(min_value=high)] if high is not None else []
        )
    else:
        parts = [st.sampled_from([math.nan, math.inf, -math.inf])]
        parts += (
            [st.floats(max_value=low, exclude_max=True, allow_nan=False, allow_infinity=False)]
            if low is not None
            else []
        )
        parts += [st.floats(min_value=high, allow_nan=False, allow_infinity=False)] if high is not None else []
    return st.one_of(parts).map(str) if parts else st.nothing()


def test_every_numeric_flag_has_a_checked_range():
    """A plain `type=int` would take any value and fail later, somewhere inside: every number a flag takes is checked
    as it is parsed (a settings field's own check, or `cli.flags.number`), so the sweep below covers it."""
    assert len(FLAGS) > 40  # every sub-command's numbers: the model's, the loop's, the data's, verify's, plan's
    unchecked = [(command, flag) for command, flag, action in FLAGS if not hasattr(action.type, "bounds")]
    assert not unchecked


@pytest.mark.parametrize(("command", "flag", "action"), FLAGS, ids=[f"{c} {f}" for c, f, _ in FLAGS])
@settings(max_examples=6, deadline=None, derandomize=True)
@given(data=st.data())
def test_out_of_range_values_are_refused_at_parse_time_naming_the_flag(command, flag, action, data):
    """Before: `translate --beam-size 0` (also -1, 1000, --alpha nan) was a 27-line traceback at the first decode,
    and exit 0 with empty input; `train --seed -1` a traceback from the batch stream. Now every out-of-range value
    of every numeric flag of every sub-command is argparse's exit 2 naming the flag, before a file is read."""
    low, high = action.type.bounds
    if low is None and high is None and action.type.__name__ == "int":
        return  # any int is a value of it (none such today)
    value = data.draw(out_of_range(action), label="value")
    argv = [command, *REQUIRED.get(command, []), flag, value]
    with pytest.raises(SystemExit) as stop, contextlib.redirect_stderr(io.StringIO()) as stderr:
        cli.build_parser().parse_args(argv)
    assert stop.value.code == 2
    err = stderr.getvalue()
    assert f"argument {flag}" in err.splitlines()[-1] and "Traceback" not in err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--beam-size", "1000"],
            "error: --beam-size 1000: more than this model's target vocabulary of 100 ids allows",
        ),
        (["--max-length", "1000"], "error: --max-length 1000: more than this model produces (max_len 16 positions"),
        (["--min-length", "40"], "error: --min-length 40: more than the longest output, 17"),
        (["--rules", "transformers", "--forced-bos", "100"], "error: --forced-bos 100: not an id of this model's"),
        (["--banned", "3,700"], "error: --banned 700: not an id of this model's target vocabulary [0, 100)"),
        (["--no-repeat-ngram-size", "2"], "error: --no-repeat-ngram-size (decode field 'no_repeat_ngram_size') is"),
    ],
)
@pytest.mark.parametrize("text", ["seven\n", ""])
def test_a_decoding_the_model_cannot_do_is_refused_before_decoding(tiny_run, tmp_path, flags, message, text):
    """Before: a traceback at the first decode (beam 1000), exit 0 with empty input, and --max-length above the
    model's positions clamped silently, --min-length above them accepted (garbage). Now each is one line naming
    the flag and the model's limit, whatever the input."""
    run, _ = tiny_run
    source = tmp_path / "input.txt"
    source.write_text(text)
    code, out, err = run_main(["translate", "--checkpoint", str(run), "--input", str(source), *flags])
    assert code == 1 and out == "" and "Traceback" not in err
    assert err.splitlines()[-1].startswith(message), err


def test_evaluate_refuses_a_beam_the_model_cannot_do(tiny_run):
    run, _ = tiny_run
    code, out, err = run_main(["evaluate", "--checkpoint", str(run), "--beam-size", "1", "60"])
    assert code == 1 and "Traceback" not in err
    assert err.splitlines()[-1].startswith("error: --beam-size 60: more than this model's target vocabulary")


@pytest.mark.parametrize("ahead", ["--compile-ahead", "--no-compile-ahead"])
@pytest.mark.parametrize("flag", ["--beam-size", "--eval-beam-size"])
def test_train_refuses_a_beam_the_model_cannot_do_before_the_run_folder(tmp_path, flag, ahead):
    """Before: a traceback from compile-ahead after the run folder was made; with --no-compile-ahead it trained,
    warned at every evaluation, exited 0 and said the best step was chosen "by validation bleu"."""
    corpus = write_corpus(tmp_path)
    run = tmp_path / "run"
    code, out, err = run_main(tiny_train_args(run, corpus, steps=2, valid=corpus, extra=(flag, "1000", ahead)))
    assert code == 1 and "Traceback" not in err
    assert err.splitlines()[-1].startswith(f"error: {flag} 1000: more than this model's target vocabulary")
    assert not run.exists()  # made for this run, and removed again: nothing was written into it


def test_a_run_whose_every_bleu_failed_does_not_claim_a_bleu_choice(tmp_path, monkeypatch):
    """A decoding failure during training is a warning (a long run goes on); the summary then says that no
    evaluation computed a score, instead of "best step N (by validation bleu)"."""
    from jax_transformer.training import loop

    def fail(*args, **kwargs):
        raise RuntimeError("decoding failed here")

    monkeypatch.setattr(loop, "evaluate_translations", fail)
    corpus = write_corpus(tmp_path)
    extra = ("--eval-sentences", "10", "--eval-every", "1", "--beam-size", "1", "--no-compile-ahead")
    code, out, err = run_main(tiny_train_args(tmp_path / "run", corpus, steps=2, valid=corpus, extra=extra))
    assert code == 0, err
    assert "warning: step 1: BLEU evaluation failed (RuntimeError: decoding failed here)" in out
    assert "best step 2 (the last: no evaluation computed a validation bleu)" in out


# --- a full disk, a closed pipe -----------------------------------------------------------------------------------


def test_a_tokenizer_that_cannot_be_written_leaves_nothing_and_names_the_file(tmp_path, monkeypatch):
    """Before (`ulimit -f 20`): `error: [Errno 27] File too large` and a truncated tokenizer.model."""
    from pathlib import Path

    real = Path.write_bytes

    def half_then_full(self, data):
        real(self, data[: len(data) // 2])
        raise OSError(errno.EFBIG, os.strerror(errno.EFBIG))

    corpus = write_corpus(tmp_path)
    run = tmp_path / "run"
    monkeypatch.setattr(Path, "write_bytes", half_then_full)
    code, out, err = run_main(tiny_train_args(run, corpus, steps=1))
    monkeypatch.undo()
    assert code == 1 and "Traceback" not in err
    assert (
        err.splitlines()[-1]
        == f"error: cannot write {run / 'tokenizer.model'}: File too large (nothing of it was written)"
    )
    assert not run.exists()  # the half-written file is gone, and so is the folder made for the run


class StdoutTo:
    """sys.stdout replaced by a text stream over file descriptor `fd` while the block runs."""

    def __init__(self, fd: int) -> None:
        self.stream = os.fdopen(fd, "w", encoding="utf-8", closefd=False)

    def __enter__(self):
        self.saved, sys.stdout = sys.stdout, self.stream
        return self.stream

    def __exit__(self, *exc) -> None:
        sys.stdout = self.saved


def translate_to(fd: int, run, source, capsys) -> tuple[int, str]:
    """`train.py translate` with stdout on `fd`: (exit code, stderr)."""
    argv = ["translate", "--checkpoint", str(run), "--input", str(source), "--beam-size", "1", "--no-progress"]
    with StdoutTo(fd):
        code = cli.main(argv)
    return code, capsys.readouterr().err


def test_translate_into_a_full_file_keeps_whole_lines_and_says_how_many(tiny_run, tmp_path, monkeypatch, capsys):
    """Before: the output ended in a partial line and nobody said how many lines were written. The disk fills
    in the middle of line 4 (a partial write, then ENOSPC, as the kernel does)."""
    from jax_transformer.decoding import translation

    run, _ = tiny_run
    source = tmp_path / "input.txt"
    source.write_text("one\ntwo\nthree\nfour\nfive\n")
    real, calls = os.write, []

    def fills_at_line_4(fd, data):
        calls.append(bytes(data))
        if len(calls) == 4:  # part of the line fits
            return real(fd, bytes(data)[:2])
        if len(calls) == 5:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data)

    monkeypatch.setattr(translation.os, "write", fills_at_line_4)
    (tmp_path / "out.txt").write_bytes(b"earlier\n")
    fd = os.open(tmp_path / "out.txt", os.O_WRONLY | os.O_APPEND)  # as the shell opens `>>`: at offset 0
    try:
        code, err = translate_to(fd, run, source, capsys)
    finally:
        os.close(fd)
    assert code == 1 and "Traceback" not in err
    assert err.splitlines()[-1] == (
        "error: cannot write to stdout: No space left on device; it holds the first 3 translations whole (cut back "
        "to them)"
    )
    written = (tmp_path / "out.txt").read_bytes()
    assert written == b"earlier\n" + b"".join(calls[:3])  # what was there, three whole lines, no partial fourth


def test_translate_whose_first_line_fails_keeps_what_the_file_held(tiny_run, tmp_path, monkeypatch, capsys):
    """`translate >> out.txt` on a full disk: nothing of the file's earlier content is cut away."""
    from jax_transformer.decoding import translation

    run, _ = tiny_run
    source = tmp_path / "input.txt"
    source.write_text("one\n")

    def full(fd, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(translation.os, "write", full)
    (tmp_path / "out.txt").write_bytes(b"earlier\n")
    fd = os.open(tmp_path / "out.txt", os.O_WRONLY | os.O_APPEND)
    try:
        code, err = translate_to(fd, run, source, capsys)
    finally:
        os.close(fd)
    assert code == 1 and err.splitlines()[-1].endswith("it holds the first 0 translations whole (cut back to them)")
    assert (tmp_path / "out.txt").read_bytes() == b"earlier\n"


def test_translate_into_a_full_device_names_it(tiny_run, tmp_path, capsys):
    """/dev/full: every write fails with ENOSPC; not a regular file, so nothing can be cut back."""
    run, _ = tiny_run
    source = tmp_path / "input.txt"
    source.write_text("one\ntwo\n")
    fd = os.open("/dev/full", os.O_WRONLY)
    try:
        code, err = translate_to(fd, run, source, capsys)
    finally:
        os.close(fd)
    assert code == 1 and "Traceback" not in err
    assert err.splitlines()[-1].startswith(
        "error: cannot write to stdout: No space left on device; it holds the first 0 translations whole"
    )


def test_translate_into_a_closed_pipe_ends_quietly(tiny_run, tmp_path, capsys):
    """Before: `translate | head -1` ended with `error: [Errno 32] Broken pipe` and exit 1. Now the end of a
    Unix tool killed by SIGPIPE: status 141, nothing said."""
    run, _ = tiny_run
    source = tmp_path / "input.txt"
    source.write_text("one\ntwo\n")
    read, write = os.pipe()
    os.close(read)  # the reader went away (`| head -1` after its line)
    try:
        code, err = translate_to(write, run, source, capsys)
    finally:
        os.close(write)
    assert code == 141
    assert "error" not in err and "Traceback" not in err and "Broken pipe" not in err


@pytest.mark.parametrize("suffix", [".safetensors", ".pt", "-hf"])
def test_export_under_a_full_disk_leaves_nothing_and_names_the_output(tiny_run, tmp_path, monkeypatch, suffix):
    """Before: a SafetensorError traceback (one file or a transformers folder)."""
    import safetensors.numpy
    import torch
    from safetensors import SafetensorError

    run, _ = tiny_run

    def full_safetensors(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"\x00" * 100)
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    def full_torch(payload, f, *args, **kwargs):
        with open(f, "wb") as out:
            out.write(b"PK")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")

    monkeypatch.setattr(safetensors.numpy, "save_file", full_safetensors)
    monkeypatch.setattr(torch, "save", full_torch)
    output = tmp_path / f"model{suffix}"
    argv = ["export", "--checkpoint", str(run), "--output", str(output)]
    code, out, err = run_main(argv + (["--format", "transformers"] if suffix == "-hf" else []))
    assert code == 1 and "Traceback" not in err
    assert err.splitlines()[-1].startswith(f"error: cannot write {output}: ")
    assert err.splitlines()[-1].endswith("(nothing of it was written)")
    assert os.listdir(tmp_path) == []  # no partial file or folder, no temporary


def test_export_refuses_an_existing_file_and_writes_the_umasks_mode(tiny_run, tmp_path):
    """Before: the one-file export overwrote an existing file (the folder export refused to), with mode 0600."""
    run, _ = tiny_run
    output = tmp_path / "model.safetensors"
    code, out, err = run_main(["export", "--checkpoint", str(run), "--output", str(output)])
    assert code == 0, err
    assert output.stat().st_mode & 0o777 == 0o666 & ~current_umask()
    before = output.read_bytes()
    code, out, err = run_main(["export", "--checkpoint", str(run), "--output", str(output)])
    assert (
        code == 1 and err.splitlines()[-1] == f"error: --output {output} already exists; choose a new name or remove it"
    )
    assert output.read_bytes() == before


def current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


# --- checkpoints ----------------------------------------------------------------------------------------------------


def test_when_the_first_save_fails_the_advice_is_to_start_again_and_that_works(tmp_path, monkeypatch):
    """Before: the error advised --resume, which then failed with "no complete checkpoint found"."""
    import orbax.checkpoint as ocp

    corpus = write_corpus(tmp_path)
    run = tmp_path / "run"
    real = ocp.CheckpointManager.save

    def refuse(self, step, *args, **kwargs):
        (run / "checkpoints" / f"{step}.orbax-checkpoint-tmp-123").mkdir(parents=True)  # what a failed save leaves
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(ocp.CheckpointManager, "save", refuse)
    args = tiny_train_args(run, corpus, steps=2, save_every=1)
    code, out, err = run_main(args)
    assert code == 1 and "Traceback" not in err
    assert err.splitlines()[-1].endswith(
        "No checkpoint of this run is complete, so there is nothing to resume: run the same command again (it "
        "removes the half-written one)"
    )
    tried = shutil.copytree(run, tmp_path / "tried")
    code, out, err = run_main(["train", "--resume", str(tried)])  # what the old message advised
    assert code == 1 and err.splitlines()[-1] == (
        f"error: --resume {tried}: no checkpoint of this run is complete, so there is nothing to resume: start it "
        f"again with the command that started it (--run-dir {tried}, without --resume)"
    )
    monkeypatch.setattr(ocp.CheckpointManager, "save", real)
    code, out, err = run_main(args)  # the advice, followed
    assert code == 0, err
    assert f"removed {run / 'checkpoints' / '1.orbax-checkpoint-tmp-123'}: the half-written first checkpoint" in out
    assert completed_steps(run) == [1, 2]


def test_an_empty_step_folder_is_named_without_absls_warning(tiny_run, tmp_path, caplog):
    """Before: absl's raw `WARNING:absl:Metadata file does not exist: ...` came before the error."""
    run = shutil.copytree(tiny_run[0], tmp_path / "run")
    (run / "checkpoints" / "9").mkdir()
    argv = ["export", "--checkpoint", str(run), "--step", "latest", "--output", str(tmp_path / "m.pt")]
    code, out, err = run_main(argv)
    assert code == 1 and "Traceback" not in err
    assert err.splitlines()[-1].startswith(f"error: checkpoint step 9 ({run / 'checkpoints' / '9'}) is damaged")
    assert not [r for r in caplog.records if "Metadata file does not exist" in r.getMessage()]


def test_import_of_a_missing_path_says_it_does_not_exist(tmp_path):
    code, out, err = run_main(["import", str(tmp_path / "opus-mt-en-de"), "--output", str(tmp_path / "run")])
    assert code == 1 and "Traceback" not in err
    assert err.splitlines()[-1].startswith(f"error: {tmp_path / 'opus-mt-en-de'}: no such file or directory")
    assert not (tmp_path / "run").exists()
