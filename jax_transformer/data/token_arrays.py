"""A training corpus encoded once into token arrays on disk and memory-mapped on every later start, so that a corpus
of millions of pairs costs neither its encoding time nor its memory again (`open_encoded`).

One cache entry, `<cache>/<file name>-<key>/`, holds raw little-endian arrays, fairseq's binarized layout:

    src.bin   int32  every kept pair's source tokens + EOS, one pair after the other
    src.idx   int64  (pairs + 1,) offsets: pair i is src.bin[src.idx[i] : src.idx[i + 1]]
    tgt.bin, tgt.idx the targets' tokens, the same way
    lines.bin int64  (pairs,) the 1-based line each pair came from (for errors and skipped-pair reports)
    meta.json        what the entry was made from (the files' size, mtime and content hash; the tokenizer's digest;
                     the empty-line policy; language columns), what the reader skipped or removed, the pairs per
                     language pair, the text fingerprint a resume checks, and each array file's size and SHA-256

A corpus of many language pairs (language columns) is stored as any other: each sentence's code is its first token.

The key is a digest of what the entry was made from, so an edited file or another tokenizer gets a new entry, never
a stale one. An entry is written into a temporary folder and renamed when whole; on every open the array files'
sizes and SHA-256 are checked against meta.json, and a truncated or damaged entry is rebuilt, never read.

Why flat arrays and not records (grain with ArrayRecord, tf.data): the batch plan (`batching`) needs every pair's
lengths before it cuts an epoch, and they are the offsets' differences here, free; a batch reads its pairs' tokens
with one gather. Record files read a batch as a thousand small records to deserialize, need a side index of lengths
anyway, and a sampler of their own would change the batch order a resume must reproduce. numpy's memmap reads these
files; no new dependency.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jax_transformer import files
from jax_transformer.data.batching import EncodedCorpus, Ragged, SpecialIds, encode_sides, fitting
from jax_transformer.data.corpus import Fingerprint, PairReader, count_lines, describe_pairs
from jax_transformer.errors import DataError, WriteError

FORMAT = 1
_ARRAYS = {"src.bin": np.int32, "src.idx": np.int64, "tgt.bin": np.int32, "tgt.idx": np.int64, "lines.bin": np.int64}
_CHUNK = 20_000  # pairs encoded at once: the tokenizer's batch encoding uses every core on each chunk
ENV = "JAX_TRANSFORMER_CACHE"


def default_cache_dir() -> Path:
    """$JAX_TRANSFORMER_CACHE, else $XDG_CACHE_HOME/jax_transformer/corpora, else ~/.cache/jax_transformer/corpora."""
    if os.environ.get(ENV):
        return Path(os.environ[ENV])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "jax_transformer" / "corpora"


# =============================================================================================================
# What an entry is made from
# =============================================================================================================


def file_identity(path: str | os.PathLike) -> dict[str, Any]:
    """{path, size, mtime, sha256} of a file: its content hash read in blocks (about a second for a 1.3 GB file)."""
    path = Path(path).absolute()
    try:
        stat, sha256 = path.stat(), _sha256(path)
    except OSError as e:
        raise DataError(f"{path}: cannot read: {e.strerror or e}") from e
    return {"path": str(path), "size": stat.st_size, "mtime": stat.st_mtime_ns, "sha256": sha256}


def describe_change(before: Sequence[dict[str, Any]], now: Sequence[dict[str, Any]]) -> str | None:
    """What changed between two lists of `file_identity`, in words; None if every file holds the same bytes."""
    changes = []
    for old, new in itertools.zip_longest(before, now):
        if old is None or new is None or old["path"] != new["path"]:
            return f"the files were {[f['path'] for f in before]}, now {[f['path'] for f in now]}"
        if old["sha256"] != new["sha256"]:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(new["mtime"] / 1e9))
            changes.append(
                f"{new['path']} was {old['size']:,} bytes, is now {new['size']:,} bytes with other content "
                f"(modified {when})"
            )
    return "; ".join(changes) or None


def tokenizer_digest(tokenizer) -> str:
    return hashlib.sha256(tokenizer.to_bytes()).hexdigest()[:16]


# =============================================================================================================
# The tokenizer's sample
# =============================================================================================================


def tokenizer_sample(
    paths: Sequence[str | os.PathLike], pairs: int, seed: int, *, on_empty: str = "skip", language_columns: bool = False
) -> list[str]:
    """The sentences a joint tokenizer trains on: the sources, then the targets, of at most `pairs` pairs, the
    lines drawn uniformly at random by np.random.default_rng((seed, 1)) (all pairs when the file has no more), in
    corpus order. Reads the whole corpus (so bad input is reported before anything trains) but holds the sample
    only. Marian (--sentencepiece-max-lines) and fairseq's recipes train SentencePiece on such a sample too."""
    lines = count_lines(paths[0])
    chosen = None
    if lines > pairs:
        chosen = np.zeros(lines + 1, dtype=bool)
        chosen[np.random.default_rng((seed, 1)).choice(lines, pairs, replace=False) + 1] = True
    sources, targets = [], []
    for line, source, target in PairReader(paths, on_empty=on_empty, language_columns=language_columns):
        if chosen is None or chosen[line]:
            sources.append(source)
            targets.append(target)
    return sources + targets


# =============================================================================================================
# One entry: written once, opened every time
# =============================================================================================================


@dataclasses.dataclass
class TokenArrays:
    """An opened cache entry: the arrays memory-mapped, and meta.json."""

    directory: Path
    meta: dict[str, Any]
    src: Ragged
    tgt: Ragged
    lines: np.ndarray

    @property
    def fingerprint(self) -> str:
        return self.meta["fingerprint"]

    def describe(self) -> str:
        """Corpus.describe's line for the pairs the entry holds."""
        m = self.meta
        return describe_pairs(
            m["origin"],
            m["pairs"],
            m["skipped_empty"],
            m["skipped_empty_lines"],
            m["boms"],
            m["crlf"],
            m.get("language_pairs"),
        )

    def encoded(self, max_len: int, on_too_long: str, ids: SpecialIds) -> EncodedCorpus:
        """The pairs that fit `max_len` (batching.fitting), still on disk."""
        return fitting(self.src, self.tgt, self.lines, self.meta["origin"], max_len, on_too_long, ids)


def open_encoded(
    paths: Sequence[str | os.PathLike],
    tokenizer,
    *,
    on_empty: str = "skip",
    language_columns: bool = False,
    cache_dir: str | os.PathLike | None = None,
    identity: list[dict[str, Any]] | None = None,
    print_fn: Callable[[str], None] = print,
    progress: bool = True,
) -> TokenArrays:
    """The corpus in `paths` (a TSV file, or a source and a target file) encoded by `tokenizer`: the cache entry
    made from these files' bytes, this tokenizer, `on_empty` and `language_columns` if there is an intact one, else
    encoded now (bad input is a DataError naming file and line, as `corpus.read_tsv`'s) and stored in `cache_dir`
    (`default_cache_dir()` when None). `identity`: the files' `file_identity`, if already computed."""
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    identity = identity or [file_identity(p) for p in paths]
    made_from = {
        "format": FORMAT,
        "files": [{k: f[k] for k in ("path", "size", "sha256")} for f in identity],
        "tokenizer": tokenizer_digest(tokenizer),
        "eos": tokenizer.eos_id,
        "on_empty": on_empty,
        **({"language_columns": True} if language_columns else {}),  # (entries without them keep their keys)
    }
    key = hashlib.sha256(json.dumps(made_from, sort_keys=True).encode()).hexdigest()[:16]
    entry = cache / f"{Path(paths[0]).name}-{key}"
    if entry.is_dir():
        problem = _damage(entry, made_from)
        if problem is None:
            return _open(entry)
        print_fn(f"warning: {entry}: {problem}; encoding the corpus again")
        shutil.rmtree(entry, ignore_errors=True)
    _check_writable(cache)
    print_fn(f"encoding {' + '.join(map(str, paths))} once into {entry} (later starts map it from disk)")
    try:
        with files.replaced_folder(entry) as temporary:  # the folder is renamed whole: its files are written plainly
            meta = _encode(paths, tokenizer, on_empty, language_columns, temporary, progress)
            meta.update(made_from=made_from, identity=identity)
            (temporary / "meta.json").write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
    except WriteError:
        if not entry.is_dir() or _damage(entry, made_from) is not None:
            raise
        # Another run encoded the same corpus at the same time and renamed its entry first: the same arrays.
    return _open(entry)


def _check_writable(cache: Path) -> None:
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise WriteError(
            f"cannot create the corpus cache folder {cache}: {e.strerror or e}; choose a writable one with "
            f"--data-cache DIR (or ${ENV})"
        ) from None
    if not os.access(cache, os.W_OK | os.X_OK):
        raise WriteError(
            f"the corpus cache folder {cache} is not writable, so the corpus cannot be encoded there; choose a "
            f"writable one with --data-cache DIR (or ${ENV})"
        )


def _encode(paths, tokenizer, on_empty: str, language_columns: bool, folder: Path, progress: bool) -> dict[str, Any]:
    """Reads and encodes the corpus chunk by chunk into the array files of `folder`; what meta.json says of it."""
    from tqdm.auto import tqdm

    reader = PairReader(paths, on_empty=on_empty, language_columns=language_columns)
    fingerprint = Fingerprint()
    eos = tokenizer.eos_id
    ends = {"src": 0, "tgt": 0}
    with contextlib.ExitStack() as stack:
        out = {name: stack.enter_context(open(folder / name, "wb")) for name in _ARRAYS}
        for side in ("src", "tgt"):
            out[f"{side}.idx"].write(np.zeros(1, np.int64).tobytes())
        total = count_lines(paths[0])
        bar = stack.enter_context(  # a corpus of fewer lines encodes in a few seconds
            tqdm(total=total, desc="encoding", unit=" lines", unit_scale=True, disable=not progress or total < 200_000)
        )
        pairs = reader.rows()
        while chunk := list(itertools.islice(pairs, _CHUNK)):
            lines, sources, targets, languages = zip(*chunk)
            for source, target, codes in zip(sources, targets, languages):
                fingerprint.add(source, target, codes)
            encoded = encode_sides(
                tokenizer, sources, targets, languages if language_columns else None, lines, reader.origin
            )
            for side, ids in zip(("src", "tgt"), encoded):
                lengths = np.fromiter(map(len, ids), np.int64, count=len(ids))
                tokens = np.fromiter(itertools.chain.from_iterable(ids), np.int32, count=int(lengths.sum()))
                if side == "src":  # the source's EOS is part of the encoder input
                    tokens, lengths = np.insert(tokens, np.cumsum(lengths), eos), lengths + 1
                out[f"{side}.bin"].write(tokens.astype("<i4").tobytes())
                out[f"{side}.idx"].write((ends[side] + np.cumsum(lengths)).astype("<i8").tobytes())
                ends[side] += int(lengths.sum())
            out["lines.bin"].write(np.asarray(lines, "<i8").tobytes())
            bar.update(reader.lines - bar.n)
    return {
        "origin": reader.origin,
        "pairs": reader.pairs,
        "skipped_empty": reader.skipped_empty,
        "skipped_empty_lines": reader.skipped_empty_lines,
        "boms": reader.stats.stripped_boms,
        "crlf": reader.stats.crlf_lines,
        "language_pairs": None if reader.language_pairs is None else dict(sorted(reader.language_pairs.items())),
        "fingerprint": fingerprint.hexdigest(),
        "arrays": {
            name: {"bytes": (folder / name).stat().st_size, "sha256": _sha256(folder / name)} for name in _ARRAYS
        },
    }


def _sha256(path: Path, block: int = 1 << 24) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            digest.update(chunk)
    return digest.hexdigest()


def _damage(entry: Path, made_from: dict[str, Any]) -> str | None:
    """Why an entry cannot be read (a missing, truncated or altered file; meta.json unreadable), or None."""
    try:
        meta = json.loads((entry / "meta.json").read_text(encoding="utf-8"))
        arrays = meta["arrays"]
        if meta["made_from"] != made_from:
            return "meta.json describes other files or another tokenizer than its name says"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"meta.json is missing or unreadable ({e})"
    for name in _ARRAYS:
        path = entry / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != arrays.get(name, {}).get("bytes"):
            return f"{name} holds {size:,} bytes, meta.json says {arrays.get(name, {}).get('bytes')} (truncated?)"
        if _sha256(path) != arrays[name].get("sha256"):
            return f"{name}'s content does not match its SHA-256 in meta.json (damaged)"
    return None


def _open(entry: Path) -> TokenArrays:
    meta = json.loads((entry / "meta.json").read_text(encoding="utf-8"))
    arrays = {name: _memmap(entry / name, dtype) for name, dtype in _ARRAYS.items()}
    return TokenArrays(
        entry,
        meta,
        Ragged(arrays["src.bin"], arrays["src.idx"]),
        Ragged(arrays["tgt.bin"], arrays["tgt.idx"]),
        arrays["lines.bin"],
    )


def _memmap(path: Path, dtype) -> np.ndarray:
    if path.stat().st_size == 0:  # numpy cannot map an empty file
        return np.zeros(0, dtype)
    return np.memmap(path, dtype=np.dtype(dtype).newbyteorder("<"), mode="r")


def entries(cache_dir: str | os.PathLike | None = None) -> Iterator[Path]:
    """The cache's entries (for a person tidying it: each is a folder that may simply be removed)."""
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return (p for p in sorted(cache.glob("*-*")) if (p / "meta.json").is_file()) if cache.is_dir() else iter(())
