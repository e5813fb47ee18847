"""The command line keeps its flags: every flag each sub-command had when the command line became a package (the
list in tests/data/cli_flags.json, read off that commit's parser by `describe` below) is still there, with the
same names, destination, type and bounds, choices, default and count. New flags may come; none may go or change
meaning. The console script runs the same main as `python train.py`."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from jax_transformer.cli.main import build_parser

REPO = Path(__file__).resolve().parent.parent
SAVED = REPO / "tests" / "data" / "cli_flags.json"


def describe(parser: argparse.ArgumentParser) -> dict[str, list[dict]]:
    """Every flag of every sub-command: what it means (names, destination, type, bounds, choices, default, count,
    required), not its help text or metavar."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    found = {}
    for name, command in sorted(sub.choices.items()):
        flags = []
        for action in command._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            bounds = getattr(action.type, "bounds", None)
            flags.append(
                {
                    "names": list(action.option_strings) or [action.dest],
                    "dest": action.dest,
                    "action": type(action).__name__,
                    "type": getattr(action.type, "__name__", None) if action.type is not None else None,
                    "bounds": list(bounds) if bounds else None,
                    "choices": list(action.choices) if action.choices is not None else None,
                    "default": action.default,
                    "nargs": action.nargs,
                    "required": action.required,
                }
            )
        found[name] = flags
    return json.loads(json.dumps(found, default=str))  # as the saved list was written


SAVED_FLAGS = json.loads(SAVED.read_text(encoding="utf-8"))
# Flags that were required and may now be left out, each for a reason (a widening: every command line that worked
# still works and means the same).
NO_LONGER_REQUIRED = {("serve", "checkpoint"): "serve --models names the checkpoints instead"}
# Flags given once that may now be repeated, each for a reason (a widening: one given once means what it meant).
NOW_REPEATABLE = {
    ("translate", "checkpoint"): "repeated, an ensemble of the runs",
    ("evaluate", "checkpoint"): "repeated, an ensemble of the runs",
    ("serve", "checkpoint"): "repeated, an ensemble of the runs",
}
NOW = describe(build_parser())


def test_every_sub_command_is_still_there():
    assert set(SAVED_FLAGS) <= set(NOW), f"sub-commands gone: {sorted(set(SAVED_FLAGS) - set(NOW))}"
    assert sum(len(v) for v in SAVED_FLAGS.values()) == 304  # the saved list is whole


@pytest.mark.parametrize("command", sorted(SAVED_FLAGS))
def test_every_flag_keeps_its_meaning(command):
    now = {flag["dest"]: flag for flag in NOW[command]}
    changed = []
    for before in SAVED_FLAGS[command]:
        after = now.get(before["dest"])
        if after is None:
            changed.append(f"{before['names']}: gone")
            continue
        if not set(before["names"]) <= set(after["names"]):
            changed.append(f"{before['names']}: now spelt {after['names']}")
        for key in ("action", "type", "bounds", "choices", "default", "nargs", "required"):
            widened = key == "required" and (command, before["dest"]) in NO_LONGER_REQUIRED and not after[key]
            # More choices keep every old one's meaning (translate --input-format jsonl).
            grown = key == "choices" and None not in (before[key], after[key])
            widened |= grown and set(before[key]) <= set(after[key])
            repeatable = (command, before["dest"]) in NOW_REPEATABLE
            widened |= repeatable and (key, before[key], after[key]) == ("action", "_StoreAction", "_AppendAction")
            if before[key] != after[key] and not widened:
                changed.append(f"{before['names'][0]} {key}: {before[key]!r} -> {after[key]!r}")
    assert not changed, f"{command}: " + "; ".join(changed)


def test_the_comparison_can_fail():
    changed = json.loads(json.dumps(NOW["translate"]))
    flag = next(f for f in changed if f["dest"] == "on_too_long")
    flag["choices"] = ["error"]
    assert flag != next(f for f in SAVED_FLAGS["translate"] if f["dest"] == "on_too_long")


def test_the_console_script_runs_the_same_main():
    """pyproject's `jax-transformer` names cli.main:main; installed (pip install -e .), it prints the same
    sub-commands as `python train.py --help`, under its own name."""
    text = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    assert 'jax-transformer = "jax_transformer.cli.main:main"' in text
    script = Path(sys.executable).parent / "jax-transformer"
    if not script.exists():
        pytest.skip(f"{script}: not installed (pip install -e . installs it)")
    by_script = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=120, check=True)
    by_file = subprocess.run(
        [sys.executable, "train.py", "--help"], capture_output=True, text=True, timeout=120, check=True, cwd=REPO
    )
    assert by_script.stdout.startswith("usage: jax-transformer ") and by_file.stdout.startswith("usage: train.py ")
    assert by_script.stdout.replace("jax-transformer", "train.py") == by_file.stdout


def test_every_error_a_user_can_cause_has_its_exit_status():
    """Each error class of jax_transformer.errors is reported by the command line with a status of its own kind
    (WriteError is an OSError: the machine's, status 1 as every OSError)."""
    import inspect

    from jax_transformer import errors
    from jax_transformer.cli.main import EXIT_ERROR, exit_codes

    classes = {c for _, c in inspect.getmembers(errors, inspect.isclass) if c.__module__ == errors.__name__}
    mapped = dict(exit_codes())
    assert classes - set(mapped) == {errors.WriteError} and issubclass(errors.WriteError, OSError)
    assert mapped[errors.TrainingError] == 3 and {mapped[c] for c in mapped if c is not errors.TrainingError} == {
        EXIT_ERROR
    }
