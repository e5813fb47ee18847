#!/usr/bin/env python3
"""What a large training corpus costs before training starts: the setup time (reading the file, the tokenizer,
encoding, the batch plan) and the peak resident memory of `train.py train` on synthetic parallel corpora of
1, 2 and 4.5 million pairs, for a first run and for a resume of it.

    python benchmarks/corpus_scale.py                                  # 1M, 2M and 4.5M pairs (many minutes)
    python benchmarks/corpus_scale.py --quick                          # 20,000 pairs: a smoke check
    python benchmarks/corpus_scale.py --pairs 1000000 --repo ../before --json before_1M.json
    python benchmarks/corpus_scale.py --pairs 1000000 --extra-flags="--batching buckets"

The corpora are made here (`make_tsv`): source<TAB>target lines of 5-25 words a side, the words drawn Zipf-like
from a fixed list of 50,000 pseudo-words, about 284 MB a million pairs; each is cached in --cache (by pairs and
seed) and reused. The tiny preset's 64 positions make train.py skip the longer pairs (the log says how many: it
depends on the tokenizer, so on what it was trained on). For each size the script runs, as child processes in
--repo (default: this repository):

    python train.py train --tsv FILE --preset tiny --steps 3 --vocab-size 8000 --run-dir DIR --no-compile-ahead
    python train.py train --resume DIR --steps 6 --no-compile-ahead

with --extra-flags appended to both (a flag that --repo's `train.py train --help` does not list is dropped, with
a note). Of each child it records the setup time (from the start of the process to its first line beginning
"model: ", which train.py prints when the run is set up) and the peak resident memory until then (VmHWM of
/proc/PID/status at that line), the wall time of the whole process and its peak resident memory (ru_maxrss of
os.wait4: it adds compiling and running the training step, whatever the corpus). The tiny model makes the three
training steps a small part of the wall time. Where the code has a corpus cache (--data-cache), each size gets a
fresh one, so the first run encodes, and the rate at which the run's batch stream cuts batches from it is measured
after emptying the page cache (root only) and again warm. Each child's output goes to a log beside --json; a child
that fails ends the script (the results so far written, its log's last lines printed). --repo may be a git
worktree of an older commit, to measure the code there with this script.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.machine import machine_info  # noqa: E402

DEFAULT_PAIRS = (1_000_000, 2_000_000, 4_500_000)
QUICK_PAIRS = 20_000
VOCABULARY = 50_000  # pseudo-words in the fixed list
WORDS_SEED = 20240607  # the list is the same for every corpus; --seed decides only which words a corpus draws
ZIPF_OFFSET = 2.7  # Zipf-Mandelbrot: the word of rank r (from 0) is drawn with probability ~ 1 / (r + 2.7)
WORDS_PER_SIDE = (5, 25)  # inclusive, uniform
LONGEST_WORD = 20
BLOCK_PAIRS = 50_000  # pairs made and written at a time (part of what the seed gives: keep it fixed)
TAIL_LINES = 30  # of a failed child's log


# =============================================================================================================
# The corpus
# =============================================================================================================


def word_list() -> tuple[np.ndarray, np.ndarray]:
    """The fixed pseudo-words by rank: a (VOCABULARY, LONGEST_WORD + 1) uint8 array of lowercase letters (zero-padded,
    a column left for the separator) and their lengths. Frequent words are shorter (3.5 + 0.6 log2(rank + 1) letters,
    jittered), as in a real language; drawn Zipf-like, a word averages ~8.5 letters: ~284 bytes a pair."""
    rng = np.random.default_rng(WORDS_SEED)
    lengths = np.rint(3.5 + 0.6 * np.log2(np.arange(VOCABULARY) + 1) + rng.normal(0, 1.5, VOCABULARY))
    lengths = np.clip(lengths, 2, LONGEST_WORD).astype(np.int64)
    letters = rng.integers(ord("a"), ord("z") + 1, size=(VOCABULARY, LONGEST_WORD + 1), dtype=np.uint8)
    letters[np.arange(LONGEST_WORD + 1)[None, :] >= lengths[:, None]] = 0
    return letters, lengths


def zipf_ranks(rng: np.random.Generator, n: int) -> np.ndarray:
    """n word ranks drawn Zipf-Mandelbrot-like: the inverse of the continuous distribution 1 / (r + ZIPF_OFFSET) on
    [0, VOCABULARY), floored (a bisection of the discrete one's cumulative sums is several times slower)."""
    q = ZIPF_OFFSET
    ranks = np.floor(q * ((VOCABULARY + q) / q) ** rng.random(n) - q).astype(np.int64)
    return np.clip(ranks, 0, VOCABULARY - 1)


def _block(rng: np.random.Generator, n: int, letters: np.ndarray, lengths: np.ndarray) -> bytes:
    """n pairs as the bytes of n source<TAB>target lines."""
    low, high = WORDS_PER_SIDE
    n_src = rng.integers(low, high + 1, n)
    n_tgt = rng.integers(low, high + 1, n)
    per_pair = n_src + n_tgt
    words = zipf_ranks(rng, int(per_pair.sum()))
    # Each word is followed by one separator: a space, the tab after a source side, the newline after a target.
    pair_start = np.cumsum(per_pair) - per_pair
    separators = np.full(len(words), ord(" "), np.uint8)
    separators[pair_start + n_src - 1] = ord("\t")
    separators[pair_start + per_pair - 1] = ord("\n")
    # Each word's row of `letters` with its separator written after the word, then the rows' bytes up to it.
    rows = letters[words]
    size = lengths[words]
    rows[np.arange(len(words)), size] = separators
    out = rows[np.arange(rows.shape[1])[None, :] <= size[:, None]]
    return out.tobytes()


def make_tsv(path: Path, pairs: int, seed: int) -> int:
    """Writes `pairs` synthetic source<TAB>target lines to path (through a temporary name); returns the bytes."""
    letters, lengths = word_list()
    rng = np.random.default_rng(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    size = 0
    with open(partial, "wb") as f:
        for start in range(0, pairs, BLOCK_PAIRS):
            data = _block(rng, min(BLOCK_PAIRS, pairs - start), letters, lengths)
            f.write(data)
            size += len(data)
    os.replace(partial, path)
    return size


def cached_tsv(cache: Path, pairs: int, seed: int) -> Path:
    """The corpus of (pairs, seed) in cache, made unless a complete one is there (its size as recorded)."""
    path = cache / f"pairs{pairs}_seed{seed}.tsv"
    record = path.with_name(path.name + ".bytes")
    try:
        if path.stat().st_size == int(record.read_text()):
            print(f"corpus: {path} ({path.stat().st_size / 1e6:.0f} MB, cached)")
            return path
    except (OSError, ValueError):
        pass
    start = time.perf_counter()
    size = make_tsv(path, pairs, seed)
    record.write_text(f"{size}\n")
    print(f"corpus: {path} ({size / 1e6:.0f} MB, made in {time.perf_counter() - start:.1f} s)")
    return path


# =============================================================================================================
# The child processes
# =============================================================================================================


def train_flags(repo: Path) -> set[str]:
    """The flags `train.py train --help` lists in repo."""
    proc = subprocess.run(
        [sys.executable, "train.py", "train", "--help"], cwd=repo, env=child_env(repo), capture_output=True, text=True
    )
    if proc.returncode != 0:
        sys.exit(f"`train.py train --help` failed in {repo}:\n{proc.stdout}{proc.stderr}")
    return set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", proc.stdout))


def known_flags(args: list[str], flags: set[str]) -> tuple[list[str], list[str]]:
    """args without the flags (and their values) that are not in `flags`; and what was dropped."""
    kept, dropped = [], []
    dropping = False
    for arg in args:
        if arg.startswith("--"):
            dropping = arg.split("=", 1)[0] not in flags
        (dropped if dropping else kept).append(arg)
    return kept, dropped


def child_env(repo: Path) -> dict[str, str]:
    """The environment of a child: unbuffered output (so that the "model: " line is seen when printed), repo's
    package first on the path."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(repo)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def peak_so_far(pid: int) -> float | None:
    """A running process's peak resident memory so far (VmHWM of /proc/PID/status), in GB."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) * 1024 / 1e9, 3)
    except OSError:
        pass
    return None


def measure(args: list[str], repo: Path, log_path: Path) -> dict:
    """Runs `python train.py *args` in repo: its setup and wall seconds, peak resident memory and exit status (a
    failure's last log lines printed); the log kept."""
    command = [sys.executable, "train.py", *args]
    print("$ " + shlex.join(command), flush=True)
    setup_s = setup_peak_gb = None
    start = time.perf_counter()
    proc = subprocess.Popen(
        command,
        cwd=repo,
        env=child_env(repo),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
    )
    with open(log_path, "w", encoding="utf-8") as log:
        for line in proc.stdout:
            if setup_s is None and line.startswith("model: "):
                setup_s = time.perf_counter() - start
                setup_peak_gb = peak_so_far(proc.pid)
            log.write(line)
            print("    " + line, end="", flush=True)
    _, status, usage = os.wait4(proc.pid, 0)
    wall_s = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait for it again
    proc.stdout.close()
    if proc.returncode != 0:
        tail = log_path.read_text(encoding="utf-8", errors="replace").splitlines()[-TAIL_LINES:]
        print(f"the child exited with {proc.returncode}; the last {len(tail)} lines of its log:", *tail, sep="\n")
    return {
        "command": command,
        "returncode": proc.returncode,
        "setup_s": None if setup_s is None else round(setup_s, 2),
        "setup_peak_gb": setup_peak_gb,  # the peak until the run was set up (VmHWM then)
        "wall_s": round(wall_s, 2),
        "peak_gb": round(usage.ru_maxrss * 1024 / 1e9, 3),  # ru_maxrss is in KiB on Linux
        "log": str(log_path),
    }


def measure_size(pairs: int, tsv: Path, repo: Path, extra: list[str], logs: Path, flags: set[str]) -> dict:
    """The first run and its resume (unless the first run fails) on one corpus; the logs are named
    logs-PAIRS-first.log and -resume.log. Where the code encodes corpora into a cache (--data-cache), a fresh one
    for this size, so the first run encodes; then the rate batches are read from it (`stream_rate`)."""
    with tempfile.TemporaryDirectory(prefix="corpus_scale_run_") as tmp:
        run_dir, cache = Path(tmp) / "run", Path(tmp) / "cache"
        cached = ["--data-cache", str(cache)] if "--data-cache" in flags else []
        first = ["train", "--tsv", str(tsv), "--preset", "tiny", "--steps", "3", "--vocab-size", "8000"]
        first += ["--run-dir", str(run_dir), *cached, *extra]
        resume = ["train", "--resume", str(run_dir), "--steps", "6", *extra]
        row = {"pairs": pairs, "file_mb": round(tsv.stat().st_size / 1e6, 1)}
        row["first"] = measure(first, repo, logs.with_name(f"{logs.name}-{pairs}-first.log"))
        if row["first"]["returncode"] == 0:
            row["resume"] = measure(resume, repo, logs.with_name(f"{logs.name}-{pairs}-resume.log"))
        if cached and row["first"]["returncode"] == 0 and repo == REPO:
            row["stream"] = {cold: stream_rate(tsv, run_dir, cache, cold=cold) for cold in ("cold", "warm")}
    return row


def drop_page_cache() -> bool:
    """Empties the kernel's page cache (root only), so the next reads come from the disk; whether it could."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        return True
    except OSError:
        return False


def stream_rate(tsv: Path, run_dir: Path, cache: Path, *, cold: str, seconds: float = 10.0) -> dict:
    """Real tokens (source and target, padding not counted) a second that the run's batch stream cuts from the
    memory-mapped arrays, for `seconds`: after emptying the page cache ("cold": read from disk) or not ("warm")."""
    sys.path.insert(0, str(REPO))
    from jax_transformer.data import token_arrays
    from jax_transformer.data.batching import BatchStream, SpecialIds
    from jax_transformer.data.tokenizer import Tokenizer
    from jax_transformer.settings.config import DataConfig, preset

    tokenizer = Tokenizer.load(run_dir / "tokenizer.model")
    arrays = token_arrays.open_encoded([tsv], tokenizer, cache_dir=cache, print_fn=lambda _: None, progress=False)
    data = DataConfig()  # the run's batching: its defaults
    encoded = arrays.encoded(preset("tiny").max_len, data.on_too_long, SpecialIds.of(tokenizer))
    dropped = drop_page_cache() if cold == "cold" else False
    stream = BatchStream(encoded, data.max_tokens, batching=data.batching, row_multiple=data.row_multiple)
    tokens = batches = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        batch = next(stream)
        tokens += int((batch["src"] != 0).sum() + (batch["tgt_out"] != 0).sum())
        batches += 1
    rate = tokens / (time.perf_counter() - start)
    print(f"stream ({cold}{'' if cold == 'warm' or dropped else ', page cache not emptied'}): {rate:,.0f} tokens/s")
    return {"tokens_per_s": round(rate), "batches": batches, "page_cache_emptied": dropped}


# =============================================================================================================
# The report
# =============================================================================================================


def machine_line(m: dict) -> str:
    """One line: CPU, cores, memory, OS, the libraries that matter, the load."""
    libs = ", ".join(f"{k} {m['libraries'].get(k, '?')}" for k in ("python", "jax", "jaxlib", "numpy"))
    return (
        f"machine: {m['cpu_model']}, {m['cores']} cores, {m['memory_gib']} GiB, {m['os']}; {libs}; "
        f"load average {m['load_average']}; {m['date']}"
    )


def _cell(run: dict | None) -> str:
    """setup s / peak GB / wall s of one child, and its exit status if it failed."""
    if run is None:
        return "not run"
    setup = "-" if run["setup_s"] is None else f"{run['setup_s']:.1f}"
    setup_peak = "-" if run.get("setup_peak_gb") is None else f"{run['setup_peak_gb']:.2f}"
    failed = f" (failed: exit status {run['returncode']})" if run["returncode"] else ""
    return f"{setup} / {setup_peak} / {run['peak_gb']:.2f} / {run['wall_s']:.1f}{failed}"


def table(rows: list[dict]) -> str:
    """The rows as a Markdown table."""
    lines = [
        "| pairs | file MB | first run: setup s / setup peak GB / peak GB / wall s "
        "| resume: setup s / setup peak GB / peak GB / wall s "
        "| stream from disk: tokens/s cold / warm |",
        "|---:|---:|---|---|---|",
    ]
    for r in rows:
        stream = r.get("stream")
        rate = "-" if not stream else f"{stream['cold']['tokens_per_s']:,} / {stream['warm']['tokens_per_s']:,}"
        lines.append(
            f"| {r['pairs']:,} | {r['file_mb']:.0f} | {_cell(r['first'])} | {_cell(r.get('resume'))} | {rate} |"
        )
    return "\n".join(lines)


def git_commit(repo: Path) -> str | None:
    """repo's checked-out commit, with " (tracked files modified)" where they differ from it; None outside git."""
    proc = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True)
    if proc.returncode != 0:
        return None
    modified = subprocess.run(["git", "-C", str(repo), "diff", "--quiet", "HEAD"], capture_output=True).returncode
    return proc.stdout.strip() + (" (tracked files modified)" if modified else "")


def main(argv: list[str] | None = None) -> None:
    """The command line: make or reuse the corpora, measure each size, print the table and write the JSON."""
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--pairs", type=int, nargs="+", default=list(DEFAULT_PAIRS), help="corpus sizes")
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_PAIRS:,} pairs: a smoke check")
    parser.add_argument("--seed", type=int, default=0, help="of the corpora (default 0)")
    parser.add_argument("--repo", type=Path, default=REPO, help="the repository whose train.py runs (default this)")
    parser.add_argument("--cache", type=Path, default=Path("/tmp/corpus_scale"), help="where the corpora are kept")
    parser.add_argument("--json", type=Path, default=Path("corpus_scale.json"), help="results; the logs beside it")
    parser.add_argument(
        "--extra-flags", default="", help='flags added to both commands, one string: --extra-flags="--batching buckets"'
    )
    args = parser.parse_args(argv)
    pairs = [QUICK_PAIRS] if args.quick else args.pairs
    repo = args.repo.resolve()
    flags = train_flags(repo)
    # --no-compile-ahead: no compilation threads compete with the setup (dropped where the flag does not exist).
    extra, dropped = known_flags(["--no-compile-ahead", *shlex.split(args.extra_flags)], flags)
    if dropped:
        print(f"not in {repo}'s `train.py train --help`, dropped: {' '.join(dropped)}")
    logs = args.json.resolve().with_suffix("")
    logs.parent.mkdir(parents=True, exist_ok=True)
    machine = machine_info()
    result = {
        "machine": machine,
        "repo": str(repo),
        "commit": git_commit(repo),
        "seed": args.seed,
        "added_flags": extra,
        "dropped_flags": dropped,
        "rows": [],
    }
    failed = []
    for n in pairs:
        tsv = cached_tsv(args.cache, n, args.seed)
        row = measure_size(n, tsv, repo, extra, logs, flags)
        result["rows"].append(row)
        args.json.write_text(json.dumps(result, indent=2) + "\n")  # after each size: a partial result survives
        failed = [run["log"] for run in (row["first"], row.get("resume")) if run and run["returncode"]]
        if failed:
            break
    result["load_average_end"] = machine_info()["load_average"]
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print()
    print(machine_line(machine))
    print(f"code: {repo} at {result['commit'] or 'unknown commit'}; flags added: {' '.join(extra) or 'none'}")
    print(table(result["rows"]))
    print(f"results: {args.json}")
    if failed:
        sys.exit(f"a child failed (its log: {failed[0]}); the sizes after it were not run")


if __name__ == "__main__":
    main()
