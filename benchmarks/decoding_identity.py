#!/usr/bin/env python3
"""Decoded tokens and scores bit for bit between two checkouts of this project, through the command line alone.

    python benchmarks/decoding_identity.py --checkout /work/before --checkout /work/main
    python benchmarks/decoding_identity.py --checkout A --checkout B --quick       # a subset, for a smoke test
    python benchmarks/decoding_identity.py --checkout A --checkout B --python .venv/bin/python --work /tmp/identity

What it proves: that the two checkouts' `train.py translate` and `train.py score` print the same bytes (every
hypothesis's text, tokens, score and per-token log-probs, as `--output-format jsonl` writes them) for the same
run directory and input, and that `train.py import` of the same transformers directory gives run directories that
decode to the same bytes. Only the command line is used (`cd CHECKOUT && PYTHON train.py ...`: train.py's folder
comes first on sys.path, so each checkout runs its own `jax_transformer`, not the installed one), so the script
works across a reorganisation of the package: it never imports `jax_transformer` itself.

The models are built once, by a child process of the first checkout (this script again, with --build-inputs and
cwd = that checkout, so the checkout's tests.helpers and the package they import are the ones used; data is
data, whichever checkout writes it):
- trained_tiny: the tests' saved model (tests/data/trained_tiny.npz) written as a run directory by
  tests/helpers/saved.py's `saved_run`; both checkouts decode that same directory.
- marian, fsmt, nllb, m2m100, mbart50: tiny random transformers models built as the tests build them
  (tests/helpers/pretrained.py, tests/helpers/multilingual.py; save_pretrained beside their tokenizer files, EOS
  raised on the tests' sentences; FSMT's generation_config given the tests' max_length 18). Each checkout runs
  `train.py import` on the same directory (its stdout is compared too, the run folder's path aside) and decodes
  its own imported run.

The inputs: the saved model's first 64 validation sentences (the imported models: the tests' 12 validation
sentences and 5 written here, an empty line among them). The cases (CASES below): greedy, beam 4 (the saved
model), n-best 3 of beam 4, the run's own decoding settings (imported models: their generation_config), sampling
with seed 7 (plain, and with --top-k / --top-p / --temperature and 3 samples), target prefixes of 0-2 words
(--input-format tsv), transformers' repetition controls (--repetition-penalty, --no-repeat-ngram-size; the saved
model with --rules transformers), `score` of source/target pairs, and `translate --document` of a few paragraphs
(the saved model). A case whose flags the first checkout's --help lacks is left out, and said so. --quick: the
saved model's n-best and score, Marian's import and greedy.

Each command must exit 0 on every checkout; stdout is compared line by line (an output is a line: one JSON object
per input line; stderr is not compared: it has timings). Commands run one at a time, every one in the same
environment (JAX_PLATFORMS=cpu, HF_HUB_OFFLINE=1, PYTHONHASHSEED=0); each checkout has a compilation cache of
its own in the work folder (its program store holds traced decoders named by the package's module paths, which a
reorganisation changes). With --work the outputs stay in WORK/<A, B>/out/.

Exit status 1 when any output differs or any command failed, naming the case and the first differing line.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `python benchmarks/decoding_identity.py` puts benchmarks/ first, not the repo
    sys.path.insert(0, str(REPO))

from benchmarks.machine import core_count, cpu_model  # noqa: E402 (stdlib only: no jax_transformer)

# The built-in task's first 12 validation pairs (default_pairs("valid", n=12)): the sentences the tests raise EOS
# on (tests/test_pretrained.py the 12, parity_tests and tests/test_multilingual.py the first 8), written out so
# that this script needs no module of either checkout to know them.
VALID_SOURCES = (
    "one hundred and three",
    "one hundred and eleven",
    "three hundred and fifty-six",
    "nine hundred and twenty-five",
    "nine hundred and eighty-seven",
    "three thousand, six hundred and sixty-six",
    "five thousand, nine hundred and twenty-nine",
    "fifty-two thousand, one hundred and eighty-five",
    "fifty-six thousand, one hundred and fifteen",
    "seventy-five thousand, nine hundred and forty-seven",
    "ninety thousand, three hundred and sixty-one",
    "one hundred and forty-five thousand, one hundred and twenty-eight",
)
VALID_TARGETS = (
    "cent trois",
    "cent onze",
    "trois cent cinquante-six",
    "neuf cent vingt-cinq",
    "neuf cent quatre-vingt-sept",
    "trois mille six cent soixante-six",
    "cinq mille neuf cent vingt-neuf",
    "cinquante-deux mille cent quatre-vingt-cinq",
    "cinquante-six mille cent quinze",
    "soixante-quinze mille neuf cent quarante-sept",
    "quatre-vingt-dix mille trois cent soixante et un",
    "cent quarante-cinq mille cent vingt-huit",
)
# Sentences of other kinds for the imported models (capitals, punctuation, an unknown word, an empty line).
HANDWRITTEN = ("Seven hundred and two!", "The train leaves at nine.", "", "twelve, thirteen and fourteen", "zebra")

# A document for `translate --document`: paragraphs of sentences joined by one or two spaces or a tab, a blank line
# between paragraphs, an indented line, a CRLF line end and no final newline.
DOCUMENT = (
    "one hundred and two. seven hundred and five!  forty-two thousand?\n"
    "\n"
    "    twelve.\tthree hundred and one. nine.\r\n"
    "\r\n"
    "sixty-six thousand, six hundred and sixty-six. one hundred"
)

# The models: family, max_length the tests decode it to, the tests' sentences its EOS is raised on, and
# --src-lang / --tgt-lang (multilingual models; tests/helpers/multilingual.py LANGUAGES).
IMPORTED = {
    "marian": {"max_length": 24, "sentences": 12, "langs": ()},  # tests/test_pretrained.py _marian_dir
    "fsmt": {"max_length": 18, "sentences": 8, "langs": ()},  # parity_tests/test_pretrained.py fsmt_dir
    "nllb": {"max_length": 20, "sentences": 8, "langs": ("eng_Latn", "fra_Latn")},  # tests/test_multilingual.py
    "m2m100": {"max_length": 20, "sentences": 8, "langs": ("en", "fr")},
    "mbart50": {"max_length": 20, "sentences": 8, "langs": ("en_XX", "fr_XX")},
}
SAVED = "trained_tiny"
N_SAVED = 64  # the saved model's validation sentences decoded


@dataclasses.dataclass(frozen=True)
class Case:
    """One command line per model: `command` (translate or score) with `flags`, reading the input file `input`."""

    name: str
    command: str
    flags: tuple[str, ...]
    input: str = "sources"  # sources, prefixes (source<TAB>prefix), pairs (source<TAB>target) or document
    models: tuple[str, ...] = ("saved", "imported")  # which models it runs on
    quick: tuple[str, ...] = ()  # on which of them it runs in the --quick subset


SAMPLE = ("--do-sample", "--sample-seed", "7")
WARPED = (*SAMPLE, "--top-k", "8", "--top-p", "0.9", "--temperature", "0.8", "--n-best", "3")
PREFIXED = ("--input-format", "tsv", "--beam-size", "4", "--n-best", "2")
REPETITION = ("--beam-size", "4", "--repetition-penalty", "1.3", "--no-repeat-ngram-size", "2")
CASES = (
    Case("greedy", "translate", ("--beam-size", "1"), quick=("imported",)),
    # (An imported model's beam 4 is the n-best case's search, its best hypothesis first; fewer calls.)
    Case("beam 4", "translate", ("--beam-size", "4"), models=("saved",)),
    Case("n-best 3 of beam 4", "translate", ("--beam-size", "4", "--n-best", "3"), quick=("saved",)),
    # An imported model's generation_config (the saved run's stored settings are beam 4's above).
    Case("stored settings", "translate", (), models=("imported",)),
    Case("sampling, seed 7", "translate", SAMPLE),
    Case("sampling top-k/top-p, 3 samples", "translate", WARPED),
    Case("prefixes, beam 4, n-best 2", "translate", PREFIXED, input="prefixes"),
    Case("repetition controls, beam 4", "translate", REPETITION),
    Case("score", "score", (), input="pairs", quick=("saved",)),
    Case("document, greedy", "translate", ("--document", "--beam-size", "1"), input="document", models=("saved",)),
)


# =============================================================================================================
# Building the inputs (a child process of the first checkout)
# =============================================================================================================


def build_inputs(folder: Path, families: list[str]) -> None:
    """Runs in a child with cwd = the first checkout (its tests.helpers and jax_transformer on sys.path): writes
    the saved model's run directory, its texts (texts.json) and a save_pretrained directory per family."""
    sys.path.insert(0, str(Path.cwd()))  # this script's own folder is sys.path[0]; the checkout's packages next
    import numpy as np
    import torch

    # One thread: the tiny models' generate calls (raising EOS) run 3x slower with two threads on a busy machine.
    torch.set_num_threads(1)

    from tests.helpers.saved import DATA, saved_run

    folder.mkdir(parents=True, exist_ok=True)
    saved_run(folder / SAVED)
    with np.load(DATA / f"{SAVED}.npz") as z:  # the texts as the tests read them (load_saved_model)
        texts = {key: [str(x) for x in z[key][:N_SAVED]] for key in ("source_texts", "target_texts")}
    (folder / "texts.json").write_text(json.dumps(texts, ensure_ascii=False), encoding="utf-8")
    for family in families:
        build = build_marian if family == "marian" else build_fsmt if family == "fsmt" else build_multilingual
        build(folder / "hf" / family, family)


def build_marian(folder: Path, family: str) -> None:
    """tests/test_pretrained.py's _marian_dir: a tiny MarianMTModel, EOS raised on the 12 sentences, and an OPUS-MT
    model's generation_config (beam 4, the pad id banned, EOS forced at max_length)."""
    from transformers import GenerationConfig, MarianTokenizer

    from tests.helpers.pretrained import end_at_various_lengths, marian_tokenizer_files, tiny_marian

    sizes = marian_tokenizer_files(folder)
    model = tiny_marian(sizes)
    settings = IMPORTED[family]
    sentences = list(VALID_SOURCES[: settings["sentences"]])
    batch = MarianTokenizer.from_pretrained(folder)(sentences, return_tensors="pt", padding=True)
    end_at_various_lengths(model, batch["input_ids"], batch["attention_mask"], settings["max_length"])
    model.generation_config = GenerationConfig(
        num_beams=4,
        max_length=settings["max_length"],
        bad_words_ids=[[sizes["pad"]]],
        decoder_start_token_id=sizes["pad"],
        eos_token_id=sizes["eos"],
        pad_token_id=sizes["pad"],
        forced_eos_token_id=sizes["eos"],
    )
    model.save_pretrained(folder)


def build_fsmt(folder: Path, family: str) -> None:
    """parity_tests/test_pretrained.py's fsmt_dir: a tiny FSMTForConditionalGeneration, EOS raised on 8 sentences,
    decoding to the tests' max_length."""
    from transformers import FSMTTokenizer

    from tests.helpers.pretrained import end_at_various_lengths, fsmt_tokenizer_files, tiny_fsmt

    model = tiny_fsmt(fsmt_tokenizer_files(folder))
    settings = IMPORTED[family]
    sentences = list(VALID_SOURCES[: settings["sentences"]])
    batch = FSMTTokenizer.from_pretrained(folder)(sentences, return_tensors="pt", padding=True)
    end_at_various_lengths(model, batch["input_ids"], batch["attention_mask"], settings["max_length"])
    # The tests pass max_length to generate; here the run stores it (transformers' default, 200, would decode
    # every unfinished output to the 64 positions, at four times the time).
    model.generation_config.max_length = settings["max_length"]
    model.save_pretrained(folder)


def build_multilingual(folder: Path, family: str) -> None:
    """tests/helpers/multilingual.py's saved_model: NLLB-200, M2M-100 or mBART-50, tiny, with the released model's
    generation settings, EOS raised on 8 sentences."""
    from tests.helpers.multilingual import saved_model

    settings = IMPORTED[family]
    saved_model(family, folder, list(VALID_SOURCES[: settings["sentences"]]), settings["max_length"])


def write_input_files(folder: Path, saved_texts: dict[str, list[str]]) -> dict[str, dict[str, Path]]:
    """{model: {input name: file}}: the sentences, source<TAB>prefix lines, source<TAB>target pairs and the
    document each model's cases read (the same files for both checkouts)."""
    sources, targets = saved_texts["source_texts"], saved_texts["target_texts"]
    imported_sources = list(VALID_SOURCES) + list(HANDWRITTEN)
    sets = {
        SAVED: (sources, targets),
        "imported": (imported_sources, list(VALID_TARGETS) + [""] * len(HANDWRITTEN)),
    }
    files: dict[str, dict[str, Path]] = {}
    for name, (srcs, tgts) in sets.items():
        out = folder / name
        out.mkdir(parents=True, exist_ok=True)
        paths = {key: out / f"{key}.txt" for key in ("sources", "prefixes", "pairs", "document")}
        paths["sources"].write_text("".join(f"{s}\n" for s in srcs), encoding="utf-8")
        # Prefixes of no, one and two target words, in turn (an empty prefix decodes as no prefix at all).
        prefixes = [" ".join(t.split()[: i % 3]) for i, t in enumerate(tgts)]
        paths["prefixes"].write_text("".join(f"{s}\t{p}\n" for s, p in zip(srcs, prefixes)), encoding="utf-8")
        # Pairs to score: each source with its reference (the hand-written ones with the first reference; the
        # empty source gives a pair with an empty side, an empty record).
        pairs = [(s, t or VALID_TARGETS[0]) for s, t in zip(srcs, tgts)]
        paths["pairs"].write_text("".join(f"{s}\t{t}\n" for s, t in pairs), encoding="utf-8")
        paths["document"].write_bytes(DOCUMENT.encode("utf-8"))
        files[name] = paths
    return files


# =============================================================================================================
# Running a checkout's command line
# =============================================================================================================


def child_env() -> dict[str, str]:
    """The one environment every process gets: CPU only, nothing downloaded, a fixed hash seed (so that a
    difference is the code's, not the run's)."""
    env = dict(os.environ)
    env.update(JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1", PYTHONHASHSEED="0", PYTHONIOENCODING="utf-8")
    return env


@dataclasses.dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str
    seconds: float


def cli(python: str, checkout: Path, args: list[str], timeout: float = 600) -> Result:
    """`cd checkout && python train.py args`: the checkout's own command line and package."""
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            [python, "train.py", *args], cwd=checkout, env=child_env(), capture_output=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return Result(124, "", f"timed out after {timeout:.0f} s", time.perf_counter() - start)
    out, err = proc.stdout.decode("utf-8", "replace"), proc.stderr.decode("utf-8", "replace")
    return Result(proc.returncode, out, err, time.perf_counter() - start)


def case_args(case: Case, run: Path, inputs: dict[str, Path], langs: tuple[str, ...], cache: Path) -> list[str]:
    """The command line of `case` on the run directory `run`: jsonl output (a document's is text, its layout)."""
    args = [case.command, "--checkpoint", str(run), "--step", "latest"]
    args += ["--tsv", str(inputs["pairs"])] if case.command == "score" else ["--input", str(inputs[case.input])]
    if case.input != "document":
        args += ["--output-format", "jsonl"]
    if langs:
        args += ["--src-lang", langs[0], "--tgt-lang", langs[1]]
    return [*args, *case.flags, "--no-progress", "--compilation-cache", str(cache)]


def flags_of(python: str, checkout: Path, command: str) -> set[str]:
    """The --flags `train.py COMMAND --help` lists: a case whose flags a checkout lacks is left out."""
    result = cli(python, checkout, [command, "--help"])
    if result.returncode != 0:
        raise SystemExit(f"{checkout}: train.py {command} --help exited with {result.returncode}: {result.stderr}")
    text = result.stdout
    return {word.strip("[],|") for word in text.split() if word.startswith(("--", "[--"))}


# =============================================================================================================
# Comparing
# =============================================================================================================


@dataclasses.dataclass
class Row:
    path: str  # model / case
    compared: int  # output lines (one per input line; import: its whole report)
    identical: int  # lines every checkout printed the same
    problem: str = ""  # a failed command or the first differing line
    times: str = ""  # each checkout's seconds (start-up and compilation included)
    failed: bool = False  # a command exited with an error


def compare(path: str, results: list[Result], labels: list[str], whole: bool = False) -> Row:
    """The stdout of each checkout line by line against the first's; `whole`: one output (the import report)."""
    times = ", ".join(f"{label} {result.seconds:.1f} s" for label, result in zip(labels, results))
    failed = [
        f"exit {r.returncode} on {label}: " + " | ".join(r.stderr.strip().splitlines()[-3:])
        for label, r in zip(labels, results)
        if r.returncode != 0
    ]
    if failed:
        return Row(path, 1, 0, "; ".join(failed), times, failed=True)
    outputs = [[r.stdout] if whole else r.stdout.splitlines(keepends=True) for r in results]
    first = outputs[0]
    row = Row(path, max(map(len, outputs)), 0, times=times)
    row.identical = sum(all(i < len(o) and o[i] == first[i] for o in outputs[1:]) for i in range(len(first)))
    for label, other in zip(labels[1:], outputs[1:]):
        differs = next((i for i in range(row.compared) if line_of(first, i) != line_of(other, i)), None)
        if differs is not None:
            row.problem = f"line {differs + 1}: {labels[0]} {short(line_of(first, differs))} | {label} "
            row.problem += short(line_of(other, differs))
            break
    if row.compared == 0:  # a case that printed nothing proves nothing
        row.problem = "no output on any checkout"
    return row


def line_of(lines: list[str], i: int) -> str | None:
    return lines[i] if i < len(lines) else None


def short(line: str | None, width: int = 240) -> str:
    """A line for the report: its repr (None: the checkout printed no such line), cut to `width` characters."""
    text = repr(line)
    return text if len(text) <= width else text[: width - 3] + "..."


# =============================================================================================================
# The machine
# =============================================================================================================


def describe(python: str, checkout: Path) -> str:
    """The checkout's commit (and whether its tree has changes) and where its `jax_transformer` is found from
    train.py's folder: it must be the checkout's own, not an installed copy."""
    git = ["git", "-C", str(checkout)]
    try:
        commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run([*git, "status", "--porcelain"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit, dirty = "", ""
    code = "import importlib.util as u; spec = u.find_spec('jax_transformer'); print(spec.origin if spec else '')"
    found = subprocess.run([python, "-c", code], cwd=checkout, env=child_env(), capture_output=True, text=True)
    origin = Path(found.stdout.strip())
    if checkout.resolve() not in origin.resolve().parents:
        raise SystemExit(f"{checkout}: jax_transformer is found at {origin}, not in the checkout; cannot compare")
    return f"{checkout} (commit {commit or '?'}{', with changes' if dirty else ''})"


def versions(python: str) -> str:
    """The interpreter's Python and the libraries that decide the numbers."""
    code = (
        "import importlib.metadata as m, platform; names = ('jax', 'jaxlib', 'flax', 'numpy', 'torch', "
        "'transformers'); print(', '.join(['python ' + platform.python_version()] + [n + ' ' + m.version(n) "
        "for n in names]))"
    )
    return subprocess.run([python, "-c", code], capture_output=True, text=True, env=child_env()).stdout.strip()


# =============================================================================================================
# Main
# =============================================================================================================


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkout", action="append", type=Path, default=[], help="a checkout (twice or more)")
    parser.add_argument("--python", default=sys.executable, help="the interpreter to run them with (default: this)")
    parser.add_argument("--work", type=Path, help="folder for the models and outputs, new or empty (default: temp)")
    parser.add_argument(
        "--quick", action="store_true", help="a smoke test: 2 cases of the saved model, Marian's import and greedy"
    )
    parser.add_argument("--build-inputs", type=Path, help=argparse.SUPPRESS)  # the child that builds the models
    parser.add_argument("--families", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.build_inputs:
        build_inputs(args.build_inputs, [f for f in args.families.split(",") if f])
        return 0
    if len(args.checkout) < 2:
        parser.error("give --checkout twice (the same one twice compares a checkout with itself)")
    checkouts = [c.resolve() for c in args.checkout]
    for c in checkouts:
        if not (c / "train.py").exists():
            parser.error(f"{c} has no train.py")
    if args.work is not None and args.work.exists() and any(args.work.iterdir()):
        parser.error(f"--work {args.work} is not empty")
    start = time.perf_counter()
    now = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    print(f"machine: {platform.processor() or platform.machine()}, {cpu_model()}, {core_count()} cores; {now}")
    print(f"python: {args.python} ({versions(args.python)})")
    labels = [chr(ord("A") + i) for i in range(len(checkouts))]
    for label, checkout in zip(labels, checkouts):
        print(f"checkout {label}: {describe(args.python, checkout)}")
    with tempfile.TemporaryDirectory(prefix="decoding_identity_") as tmp:
        work = (args.work or Path(tmp)).resolve()
        return run_all(args.python, checkouts, labels, work, args.quick, args.work is not None, start)


def run_all(
    python: str, checkouts: list[Path], labels: list[str], work: Path, quick: bool, keep: bool, start: float
) -> int:
    """Builds the inputs with the first checkout, runs every case on every checkout, prints the table."""
    families = ["marian"] if quick else list(IMPORTED)
    inputs = work / "inputs"
    built = time.perf_counter()
    build = [python, str(Path(__file__).resolve()), "--build-inputs", str(inputs), "--families", ",".join(families)]
    proc = subprocess.run(build, cwd=checkouts[0], env=child_env(), capture_output=True, text=True)
    if proc.returncode != 0:
        print(proc.stdout + proc.stderr, file=sys.stderr)
        print(f"building the models with {checkouts[0]} failed (exit {proc.returncode})")
        return 1
    print(f"models built with checkout A in {time.perf_counter() - built:.0f} s: {SAVED}, {', '.join(families)}")
    files = write_input_files(work / "texts", json.loads((inputs / "texts.json").read_text(encoding="utf-8")))

    # Cases whose flags the first checkout (the one before a change) does not have are left out, and said so.
    known = {command: flags_of(python, checkouts[0], command) for command in ("translate", "score")}
    missing = {c.name: [f for f in c.flags if f.startswith("--") and f not in known[c.command]] for c in CASES}
    for name, flags in missing.items():
        if flags:
            print(f"left out: {name} (train.py has no {', '.join(flags)})")

    def cases(model: str) -> list[Case]:
        """The cases that run on `model` ("saved" or "imported") in this run."""
        return [c for c in CASES if model in (c.quick if quick else c.models) and not missing[c.name]]

    rows: list[Row] = []

    def run_case(path: str, commands: list[list[str]], runs: list[Path] | None = None) -> Row:
        """Each checkout's command line in turn (never two at once), its output kept in WORK/<label>/out/, the
        outputs compared; `runs`: the import's report, whose run folder is each checkout's own."""
        results = [cli(python, checkout, command) for checkout, command in zip(checkouts, commands)]
        for label, result, run in zip(labels, results, runs or [None] * len(labels)):
            if run is not None:
                result.stdout = result.stdout.replace(str(run), "<run>")
            kept = work / label / "out" / re.sub(r"[^A-Za-z0-9]+", "_", path).strip("_")
            kept.parent.mkdir(parents=True, exist_ok=True)
            kept.with_suffix(".stdout").write_text(result.stdout, encoding="utf-8")
            kept.with_suffix(".stderr").write_text(result.stderr, encoding="utf-8")
        rows.append(report(compare(path, results, labels, whole=runs is not None)))
        return rows[-1]

    caches = [work / label / "cache" for label in labels]
    # The saved model: one run directory, decoded by every checkout.
    for case in cases("saved"):
        if "--repetition-penalty" in case.flags:  # transformers' controls need its rules; the run has gnmt's
            case = dataclasses.replace(case, flags=("--rules", "transformers", *case.flags))
        run_case(f"{SAVED} / {case.name}", [case_args(case, inputs / SAVED, files[SAVED], (), c) for c in caches])

    # The imported models: each checkout imports the same directory and decodes its own run.
    for family in families:
        source, langs = inputs / "hf" / family, IMPORTED[family]["langs"]
        runs = [work / label / "runs" / family for label in labels]
        if run_case(f"{family} / import", [["import", str(source), "--output", str(r)] for r in runs], runs).failed:
            continue
        for case in cases("imported"):
            commands = [case_args(case, run, files["imported"], langs, c) for run, c in zip(runs, caches)]
            run_case(f"{family} / {case.name}", commands)

    print()
    print("| path | outputs compared | identical |")
    print("|---|---:|---:|")
    for row in rows:
        print(f"| {row.path} | {row.compared} | {row.identical} |")
    differing = [row for row in rows if row.problem or row.identical != row.compared]
    for row in differing:
        print(f"DIFFERS: {row.path}: {row.problem}")
    if differing:
        print(f"outputs: {work}/<checkout>/out/" if keep else "(rerun with --work DIR to keep the outputs)")
    compared, identical = sum(r.compared for r in rows), sum(r.identical for r in rows)
    print(f"\nwall time {time.perf_counter() - start:.0f} s")
    print(f"{compared} outputs compared, {identical} identical")
    return 1 if differing else 0


def report(row: Row) -> Row:
    """A case's line as it finishes (the table comes at the end), so a long run shows where it is."""
    state = "identical" if not row.problem and row.identical == row.compared else f"DIFFERS ({row.problem})"
    print(f"  {row.path}: {row.identical}/{row.compared} {state} ({row.times})", flush=True)
    return row


if __name__ == "__main__":
    sys.exit(main())
