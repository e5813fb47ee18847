"""What a new user runs into, fixed: `score` on corpora with long lines, `score`'s files told apart, the metavars of
every flag, an API key file checked before the model loads, and `translate`'s TSV rows for empty lines. Beside them,
hypothesis over `score`'s and `import`'s inputs: any input gives a result or a named error, never a traceback."""

from __future__ import annotations

import argparse
import json
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jax_transformer.cli.main import build_parser
from tests.helpers.saved import saved_run
from tests.helpers.training import run_main

LONG = " ".join(["seven hundred and seventy-seven thousand"] * 120)  # about 600 tokens: more than max_len


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return saved_run(tmp_path_factory.mktemp("slips") / "run")


def _score(run_dir, *flags):
    return run_main(["score", "--checkpoint", str(run_dir), "--step", "latest", "--no-progress", *flags])


# --- score ---------------------------------------------------------------------------------------------------


def test_score_stops_at_a_long_line_after_writing_the_lines_before_it(run_dir, tmp_path):
    pairs = tmp_path / "pairs.tsv"
    pairs.write_text(f"un\tone\n\tvide\n{LONG}\tsept\ndeux\ttwo\n", encoding="utf-8")
    code, out, err = _score(run_dir, "--tsv", str(pairs))
    assert code == 1 and f"{pairs}, line 3:" in err and "--on-too-long skip" in err, err
    records = out.split("\n")
    assert len(records) == 3 and float(records[0]) < 0 and records[1:] == ["", ""]  # lines 1 and 2, then the stop


def test_score_skips_long_lines_with_an_empty_record_in_place(run_dir, tmp_path):
    pairs = tmp_path / "pairs.tsv"
    pairs.write_text(f"un\tone\n{LONG}\tsept\ndeux\ttwo\n\tempty\n", encoding="utf-8")
    code, out, err = _score(run_dir, "--tsv", str(pairs), "--on-too-long", "skip", "--output-format", "jsonl")
    assert code == 0, err
    records = [json.loads(line) for line in out.splitlines()]
    assert [r["line"] for r in records] == [1, 2, 3, 4]
    assert [r["score"] is None for r in records] == [False, True, False, True]  # long, and an empty side
    assert "scored 2 pairs; skipped 1 longer than the model takes (an empty record each: lines 2)" in err
    code, text, _ = _score(run_dir, "--tsv", str(pairs), "--on-too-long", "skip")
    assert text.splitlines()[1] == "" and len(text.splitlines()) == 4


def test_score_takes_a_tsv_or_two_files_not_both(run_dir, tmp_path):
    pairs = tmp_path / "pairs.tsv"
    pairs.write_text("un\tone\n", encoding="utf-8")
    code, _, err = _score(run_dir, "--tsv", str(pairs), "--src", str(pairs), "--tgt", str(pairs))
    assert code == 1 and "--tsv" in err and "it takes no --src and --tgt" in err, err


def test_the_line_count_message_names_what_the_shorter_file_lacks(run_dir, tmp_path):
    (tmp_path / "a.fr").write_text("un\n", encoding="utf-8")
    (tmp_path / "b.en").write_text("one\ntwo\n", encoding="utf-8")
    code, _, err = _score(run_dir, "--src", str(tmp_path / "a.fr"), "--tgt", str(tmp_path / "b.en"))
    assert code == 1 and f"line 2 of {tmp_path / 'b.en'} has no source sentence in {tmp_path / 'a.fr'}" in err, err
    code, _, err = _score(run_dir, "--src", str(tmp_path / "b.en"), "--tgt", str(tmp_path / "a.fr"))
    assert code == 1 and f"line 2 of {tmp_path / 'b.en'} has no translation in {tmp_path / 'a.fr'}" in err, err


# --- translate -----------------------------------------------------------------------------------------------


def test_tsv_output_has_a_row_for_an_empty_line():
    from jax_transformer.decoding.translation import format_translation

    assert format_translation(None, 3, "tsv") == ["3\t\t\t"]
    assert (
        format_translation(None, 3, "text") == [""]
        and json.loads(format_translation(None, 3, "jsonl")[0])["hypotheses"] == []
    )


def test_translate_tsv_keeps_one_row_per_empty_input_line(run_dir, tmp_path):
    (tmp_path / "in.txt").write_text("un\n\ndeux\n", encoding="utf-8")
    args = ["translate", "--checkpoint", str(run_dir), "--step", "latest", "--input", str(tmp_path / "in.txt")]
    code, out, err = run_main([*args, "--output-format", "tsv", "--no-progress", "--beam-size", "1"])
    assert code == 0, err
    assert [row.split("\t")[0] for row in out.splitlines()] == ["1", "2", "3"] and out.splitlines()[1] == "2\t\t\t"


# --- flags ---------------------------------------------------------------------------------------------------

PARSER = build_parser()
SUB = next(a for a in PARSER._actions if isinstance(a, argparse._SubParsersAction))
FILES = {"src", "tgt", "tsv", "valid_src", "valid_tgt", "valid_tsv", "init_from_torch", "input", "json", "output"}
FILES |= {"api_key_file", "models", "glossary"}
FOLDERS = {"data_cache", "compilation_cache", "checkpoint", "run_dir", "resume", "init_from", "runs"}


def _flags():
    for command, parser in sorted(SUB.choices.items()):
        for action in parser._actions:
            if action.option_strings and action.nargs != 0 and not isinstance(action, argparse._HelpAction):
                yield command, action


def _field(action) -> str:
    return action.dest.split(".")[-1]


@pytest.mark.parametrize("command", sorted(SUB.choices))
def test_no_flag_but_a_file_shows_file_in_the_help(command):
    """Read off each sub-command's help as printed: FILE only for flags that take a file; a code shows CODE, a
    number N, X or K, a folder DIR."""
    text = SUB.choices[command].format_help()
    wrong = []
    for action in SUB.choices[command]._actions:
        if not action.option_strings or action.nargs == 0 or isinstance(action, argparse._HelpAction):
            continue
        flag, field = action.option_strings[0], _field(action)
        shown = re.search(rf"{re.escape(flag)} ([A-Z][A-Z:_]*)", text)
        shown = shown.group(1) if shown else None
        number = getattr(action.type, "__name__", None) in ("int", "float")
        if shown == "FILE" and field not in FILES:
            wrong.append(f"{flag} shows FILE")
        if field.endswith(("_lang", "_language")) and shown != "CODE":
            wrong.append(f"{flag} shows {shown}, a code")
        if number and action.choices is None and shown not in ("N", "X", "K"):
            wrong.append(f"{flag} shows {shown}, a number")
        if field in FOLDERS and not (command in ("average", "import") and field == "output") and shown != "DIR":
            wrong.append(f"{flag} shows {shown}, a folder")
    assert not wrong, f"{command}: " + "; ".join(wrong)


def test_every_text_setting_declares_its_metavar():
    """A settings field that is text names what it holds (FILE, DIR, CODE, ...); the help's TEXT is for free text."""
    import dataclasses
    import typing

    from jax_transformer.settings import config

    undeclared = []
    for cls in (config.TransformerConfig, config.OptimConfig, config.DataConfig, config.LoopConfig,
                config.DecodeConfig, config.ServeConfig, config.ParallelConfig):  # fmt: skip
        hints = typing.get_type_hints(cls)
        for field in dataclasses.fields(cls):
            kinds = [t for t in typing.get_args(hints[field.name]) if t is not type(None)] or [hints[field.name]]
            if kinds[0] is str and not field.metadata.get("choices") and not field.metadata.get("metavar"):
                undeclared.append(f"{cls.__name__}.{field.name}")
    assert not undeclared, undeclared


def test_the_tsv_input_help_says_what_a_line_without_a_tab_is():
    assert "a line without a tab: none" in " ".join(SUB.choices["translate"].format_help().split())


# --- serve ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("content", [None, "", "  \n"])
def test_an_api_key_file_is_checked_before_the_model_loads(tmp_path, content):
    key = tmp_path / "key.txt"
    if content is not None:
        key.write_text(content, encoding="utf-8")
    missing_run = tmp_path / "no-such-run"  # were the model loaded first, this would be the error
    code, _, err = run_main(["serve", "--checkpoint", str(missing_run), "--api-key-file", str(key)])
    assert code == 1 and "--api-key-file" in err and str(missing_run) not in err, err


# --- any input: a result or a named error ------------------------------------------------------------------

TEXT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40)
LINES = st.lists(st.one_of(TEXT, st.just(LONG), st.just(""), TEXT.map(lambda t: t + "\t" + t)), max_size=5)


@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(lines=LINES, tabs=st.lists(st.integers(0, 3), max_size=5), crlf=st.booleans(), raw=st.binary(max_size=12))
def test_any_score_input_gives_scores_or_a_named_error(run_dir, tmp_path_factory, lines, tabs, crlf, raw):
    folder = tmp_path_factory.mktemp("score_input")
    rows = ["\t".join([line] * (n + 1)) if n != 1 else line for line, n in zip(lines, tabs + [1] * len(lines))]
    data = ("\r\n" if crlf else "\n").join(rows).encode("utf-8") + raw
    (folder / "pairs.tsv").write_bytes(data)
    code, out, err = _score(run_dir, "--tsv", str(folder / "pairs.tsv"), "--on-too-long", "skip")
    assert "Traceback" not in err
    assert code == 0 or (code == 1 and err.strip().splitlines()[-1].startswith(f"error: {folder / 'pairs.tsv'}")), err


FILES_OF_A_MODEL = st.dictionaries(
    st.sampled_from(["config.json", "adapter_config.json", "model.safetensors", "tokenizer.json", "vocab.json"]),
    st.one_of(
        st.binary(max_size=30),
        st.dictionaries(st.sampled_from(["model_type", "d_model", "r", "vocab_size"]), st.integers(-2, 40)).map(
            lambda d: json.dumps(d).encode()
        ),
        st.just(b'{"model_type": "marian"}'),
        st.just(b'{"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}'),
    ),
    max_size=3,
)


@settings(max_examples=20, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(files=FILES_OF_A_MODEL, base=st.booleans())
def test_any_import_source_gives_a_run_or_a_named_error(tmp_path_factory, files, base):
    folder = tmp_path_factory.mktemp("import_input")
    source = folder / "model"
    source.mkdir()
    for name, content in files.items():
        (source / name).write_bytes(content)
    args = ["import", str(source), "--output", str(folder / "out")]
    if base:
        args += ["--base", str(source)]
    code, out, err = run_main(args)
    assert "Traceback" not in err
    assert code == 1 and err.strip().startswith("error: ") and not (folder / "out").exists(), err
