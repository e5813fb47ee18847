"""fairseq 0.12.2's `LexicallyConstrainedBeamSearch`, loaded from its sdist and driven with the twin's log-probs
(test-only: never shipped, never a dependency).

fairseq's sdist does not build here (a C++ source is missing from it), but `fairseq/search.py` and
`fairseq/token_generation_constraints.py` are plain torch: `fairseq_search_modules` unpacks only those two and
loads them under a stub `fairseq` package (their one import of fairseq is `search.py`'s of the other file).
`generate` is the part of fairseq's `SequenceGenerator._generate` that decides the tokens, rewritten here with the
search object doing its own work: the same per-step log-prob bans, the same calls into the search, the same
finalization, pruning and choice of the next live set. What is left out cannot change the tokens: incremental
states (the twin re-runs its decoder over each whole prefix), attention, alignments, LM fusion, prefixes,
repeated n-gram blocking and match_source_len (all off here).
"""

from __future__ import annotations

import hashlib
import importlib.util
import math
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import types
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

VERSION = "0.12.2"
SDIST = f"fairseq-{VERSION}.tar.gz"
SDIST_SHA256 = "34f1b18426bf3844714534162f065ab733e049597476daa35fffb4d06a92b524"  # the registry's file
FILES = ("fairseq/search.py", "fairseq/token_generation_constraints.py")
CACHE_ENV = "FAIRSEQ_SDIST_DIR"  # a folder holding (or to receive) the sdist


class Unavailable(RuntimeError):
    """The sdist could not be had (no network, no pip): the caller skips, with this message as the reason."""


def _sdist(folder: Path) -> Path:
    """The sdist in `folder`, downloaded there by pip if it is not yet (--no-build-isolation: pip would otherwise
    set up a build environment to read its metadata, which stalls here). pip writes into a fresh folder and the file
    is then moved in whole, so test processes running side by side never read half a file."""
    path = folder / SDIST
    if not path.exists():
        fresh = Path(tempfile.mkdtemp(dir=folder))
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-build-isolation", "--no-binary",
                   ":all:", "--retries", "1", "--timeout", "20", f"fairseq=={VERSION}", "-d", str(fresh)]  # fmt: skip
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=120)
            if done.returncode != 0 or not (fresh / SDIST).exists():
                raise Unavailable(f"pip download of fairseq=={VERSION}'s sdist failed: {done.stderr.strip()[-300:]}")
            os.replace(fresh / SDIST, path)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise Unavailable(f"pip download of fairseq=={VERSION}'s sdist failed: {e}") from e
        finally:
            shutil.rmtree(fresh, ignore_errors=True)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        raise Unavailable(f"{path}: sha256 {digest}, not the registry's {SDIST} ({SDIST_SHA256})")
    return path


def _unpacked(folder: Path) -> Path:
    """`folder`/fairseq-<version>/ holding only FILES, unpacked from the sdist once (each file moved in whole)."""
    root = folder / f"fairseq-{VERSION}"
    if not all((root / name).exists() for name in FILES):
        with tarfile.open(_sdist(folder)) as archive, tempfile.TemporaryDirectory(dir=folder) as fresh:
            members = [archive.getmember(f"fairseq-{VERSION}/{name}") for name in FILES]
            archive.extractall(fresh, members=members, filter="data")
            for name in FILES:
                (root / name).parent.mkdir(parents=True, exist_ok=True)
                os.replace(Path(fresh) / f"fairseq-{VERSION}" / name, root / name)
    return root


def _load(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # search.py imports the constraints module by this name
    spec.loader.exec_module(module)
    return module


def fairseq_search_modules(folder: str | os.PathLike | None = None) -> tuple[types.ModuleType, types.ModuleType]:
    """(fairseq.search, fairseq.token_generation_constraints) of the sdist, loaded under a stub `fairseq` package
    that holds nothing else; sys.modules is left as it was. `folder`: where the sdist is kept (default
    $FAIRSEQ_SDIST_DIR). Raises `Unavailable` when the sdist cannot be had."""
    folder = Path(folder or os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "fairseq-sdist")
    folder.mkdir(parents=True, exist_ok=True)
    root = _unpacked(folder) / "fairseq"
    names = ("fairseq", "fairseq.token_generation_constraints", "fairseq.search")
    saved = {name: sys.modules.get(name) for name in names}
    try:
        stub = types.ModuleType("fairseq")
        stub.__path__ = []  # a package with no files: nothing else of fairseq can be imported through it
        sys.modules["fairseq"] = stub
        constraints = _load("fairseq.token_generation_constraints", root / "token_generation_constraints.py")
        search = _load("fairseq.search", root / "search.py")
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
    return search, constraints


class _Dictionary:
    """What `Search.__init__` reads of fairseq's target Dictionary: pad, unk, eos and the vocabulary size."""

    def __init__(self, pad: int, unk: int, eos: int, size: int):
        self._pad, self._unk, self._eos, self._size = pad, unk, eos, size

    def pad(self) -> int:
        return self._pad

    def unk(self) -> int:
        return self._unk

    def eos(self) -> int:
        return self._eos

    def __len__(self) -> int:
        return self._size


@dataclass
class Finalized:
    """One of fairseq's finalized hypotheses: its tokens (EOS last), score (log P / len ** len_penalty, len counting
    EOS) and whether it was forced to end at the length limit (fairseq's last step allows only EOS)."""

    tokens: list[int]
    score: float
    at_limit: bool


@torch.no_grad()
def generate(
    modules,
    model,
    src: torch.Tensor,
    phrases,
    *,
    beam_size: int,
    ordered: bool,
    len_penalty: float = 1.0,
    max_len_a: float = 0.0,
    max_len_b: int = 200,
    min_len: int = 1,
    suppress: tuple[int, ...] = (),
) -> list[list[Finalized]]:
    """fairseq's constrained beam search on the twin `model` (torch_reference) -> each row's finalized hypotheses,
    best first. src (B, S) long; phrases: each row's list of id lists (fairseq's --constraints); `suppress`: ids
    never produced (its token_indices_to_suppress); the other arguments as SequenceGenerator's (lenpen, max_len_a,
    max_len_b, min_len; unk_penalty 0, normalize_scores on, no temperature)."""
    search_module, constraints_module = modules
    cfg = model.cfg
    V, pad, eos = cfg.tgt_vocab_size, cfg.pad_id, cfg.eos_id
    unk = getattr(cfg, "unk_id", None)
    search = search_module.LexicallyConstrainedBeamSearch(
        _Dictionary(pad, eos if unk is None else unk, eos, V), "ordered" if ordered else "unordered"
    )
    packed = constraints_module.pack_constraints([[torch.tensor(p) for p in row] for row in phrases])
    search.init_constraints(packed, beam_size)  # one state per beam, each row's phrases as a trie / a sequence

    bsz, src_len = src.shape
    # fairseq's length rule: src_len is the padded width (EOS included); steps 0 .. max_len, the last EOS only.
    max_len = min(int(max_len_a * src_len + max_len_b), cfg.max_len - 1)
    memory = model.encode(src)  # (B, S, D)
    tokens = torch.full((bsz * beam_size, max_len + 2), pad, dtype=torch.long)  # +2: the start token and EOS
    tokens[:, 0] = cfg.start_id  # fairseq's bos_token: this model's decoder start (fairseq's own models use EOS)
    scores = torch.zeros(bsz * beam_size, max_len + 1)  # cumulative log P after each step
    # Live slots left empty when a step had fewer than K candidates that do not end: fairseq then ignores the EOS
    # candidates at those positions (its rule, copied as it is).
    cands_to_ignore = torch.zeros(bsz, beam_size, dtype=torch.bool)
    finalized: list[list[Finalized]] = [[] for _ in range(bsz)]
    sentences = torch.arange(bsz)  # the original row of each sentence still searched
    cand_size = 2 * beam_size  # the candidates a step returns: 2K, in case half end
    cand_offsets = torch.arange(cand_size)

    for step in range(max_len + 1):
        rows = sentences.repeat_interleave(beam_size)  # (bsz * K,) each hypothesis's source row
        logits = model.decode(memory[rows], src[rows], tokens[:, : step + 1])[:, -1]  # (bsz * K, V)
        lprobs = F.log_softmax(logits.float(), dim=-1)
        lprobs[lprobs != lprobs] = -math.inf  # NaN: impossible
        lprobs[:, pad] = -math.inf  # never select pad (the one ban fairseq always makes)
        if step >= max_len:  # the last step: only EOS, with its own log-prob
            lprobs[:, :eos] = -math.inf
            lprobs[:, eos + 1 :] = -math.inf
        if step < min_len:  # fairseq's min_len 1: no empty output
            lprobs[:, eos] = -math.inf
        if suppress:  # token_indices_to_suppress: the ids our rules never produce (BOS)
            lprobs[:, list(suppress)] = -math.inf

        # The search: EOS banned where a phrase is unmet, candidates gathered, banks, stripes; 2K, stripe order.
        cand_scores, cand_indices, cand_beams = search.step(
            step, lprobs.view(bsz, -1, V), scores.view(bsz, beam_size, -1)[:, :, :step], tokens[:, : step + 1],
            sentences,
        )  # fmt: skip
        cand_bbsz_idx = cand_beams + (torch.arange(bsz) * beam_size)[:, None]  # (bsz, 2K) the parents' rows

        # Finalize the EOS candidates among the first K (in stripe order, not score order), while a row has
        # fewer than K; a row is done when it has K, or at the last step: fairseq's stopping rule, which decides
        # which finished hypotheses there are to choose from. A row is only checked on a step where one ended.
        eos_mask = cand_indices.eq(eos) & cand_scores.ne(-math.inf)
        eos_mask[:, :beam_size][cands_to_ignore] = False
        done = []
        for b in range(bsz):
            sent = int(sentences[b])
            ended = [j for j in range(beam_size) if eos_mask[b, j]]
            for j in ended:
                if len(finalized[sent]) < beam_size:
                    parent = int(cand_bbsz_idx[b, j])
                    hyp = tokens[parent, 1 : step + 1].tolist() + [eos]
                    score = float(cand_scores[b, j]) / (step + 1) ** len_penalty  # normalize_scores: len counts EOS
                    finalized[sent].append(Finalized(hyp, score, step == max_len))
            if ended and (len(finalized[sent]) == beam_size or step == max_len):
                done.append(b)
        if len(done) == bsz:
            break
        # fairseq asserts here: a row still searched at the last step (no EOS could end it: a phrase unmet).
        assert step < max_len, f"fairseq's generator fails (assert step < max_len) on rows {sentences.tolist()}"

        if done:  # drop the finished rows from the batch and from the search's states, which must stay aligned
            keep = torch.tensor([b for b in range(bsz) if b not in done])
            search.prune_sentences(keep)
            eos_mask, cand_beams = eos_mask[keep], cand_beams[keep]
            cand_scores, cand_indices = cand_scores[keep], cand_indices[keep]
            cands_to_ignore, sentences = cands_to_ignore[keep], sentences[keep]
            scores = scores.view(bsz, -1)[keep].view(len(keep) * beam_size, -1)
            tokens = tokens.view(bsz, -1)[keep].view(len(keep) * beam_size, -1)
            bsz = len(keep)
            cand_bbsz_idx = cand_beams + (torch.arange(bsz) * beam_size)[:, None]

        # The next live set: the first K candidates (in the search's order) that do not end.
        eos_mask[:, :beam_size] = ~((~cands_to_ignore) & (~eos_mask[:, :beam_size]))
        active_mask = eos_mask.long() * cand_size + cand_offsets[: eos_mask.size(1)]
        new_cands_to_ignore, active_hypos = torch.topk(active_mask, k=beam_size, dim=1, largest=False)
        cands_to_ignore = new_cands_to_ignore.ge(cand_size)[:, :beam_size]
        assert (~cands_to_ignore).any(dim=1).all()
        active_bbsz_idx = torch.gather(cand_bbsz_idx, 1, active_hypos).view(-1)
        tokens[:, : step + 1] = tokens[active_bbsz_idx, : step + 1]
        tokens.view(bsz, beam_size, -1)[:, :, step + 1] = torch.gather(cand_indices, 1, active_hypos)
        if step > 0:
            scores[:, :step] = scores[active_bbsz_idx, :step]
        scores.view(bsz, beam_size, -1)[:, :, step] = torch.gather(cand_scores, 1, active_hypos)
        search.update_constraints(active_hypos)  # the live hypotheses' constraint states follow them

    return [sorted(row, key=lambda h: -h.score) for row in finalized]
