"""`train.py translate` on input of any size: read and decoded a chunk at a time, exactly one output line per input
line (empty stays empty), a progress bar on stderr, the too-long rule, and bad bytes named by line."""

from __future__ import annotations

import codecs
import io
import sys

import pytest

from jax_transformer.checkpoint import manager as ckpt_lib
from jax_transformer.decoding.translation import translate, translate_lines
from jax_transformer.settings.config import DecodeConfig
from tests.helpers.training import run_main, tiny_train_args, write_corpus


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("translate")
    run = root / "run"
    code, out, err = run_main(tiny_train_args(run, write_corpus(root), steps=2))
    assert code == 0, out + err
    return run, ckpt_lib.load(run, "latest")


LONG = " ".join(["seven hundred and seventy-seven thousand"] * 6)  # far beyond max_len=16 tokens


def test_translate_a_file_one_line_per_line_with_progress(trained, tmp_path):
    run, loaded = trained
    lines = ["one", "", "two hundred", "   ", "twelve\u2028thirteen", "three"]  # U+2028 is not a line break here
    path = tmp_path / "input.txt"
    path.write_bytes(codecs.BOM_UTF8 + "\r\n".join(lines[:-1]).encode() + b"\r\n" + lines[-1].encode())  # no final \n
    code, out, err = run_main(
        ["translate", "--checkpoint", str(run), "--input", str(path), "--beam-size", "1", "--progress"]
    )
    assert code == 0, out + err
    output = out.split("\n")
    assert output[-1] == "" and len(output) - 1 == len(lines)  # one line out per line in, each ended by "\n"
    expected = translate(
        loaded.params, loaded.config, loaded.tokenizer, [x for x in lines if x.strip()], DecodeConfig(beam_size=1)
    )
    assert [x for x, line in zip(output, lines) if line.strip()] == expected  # in order, each its own translation
    assert [x for x, line in zip(output, lines) if not line.strip()] == ["", ""]
    assert "translate: 100%" in err and "6/6" in err  # tqdm's bar on stderr, counting lines
    assert "translated 4 lines (6 read, 2 empty)" in err


def test_translate_streams_in_chunks(trained):
    """Memory is bounded by the chunk: every output is written before more than `chunk_size` further input
    lines have been read (here 2,500 lines, mostly empty so that the test decodes little)."""
    _, loaded = trained
    read, written_after = 0, []

    def lines():
        nonlocal read
        for i in range(2500):
            read += 1
            yield "one" if i % 500 == 0 else ""

    translate_lines(
        loaded.params,
        loaded.config,
        loaded.tokenizer,
        lines(),
        lambda _: written_after.append(read),
        chunk_size=100,
        progress=False,
        decode=DecodeConfig(beam_size=1),
    )
    assert len(written_after) == 2500
    assert all(reads - written <= 100 for written, reads in enumerate(written_after))


def test_translate_from_stdin(trained, monkeypatch):
    run, _ = trained
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"one\n\ntwo\n")))
    code, out, err = run_main(["translate", "--checkpoint", str(run), "--beam-size", "1"])
    assert code == 0, out + err
    assert len(out.split("\n")) == 4 and out.split("\n")[1] == "" and "translated 2 lines (3 read, 1 empty)" in err


def test_translate_too_long_lines_error_or_truncate(trained, tmp_path):
    run, loaded = trained
    path = tmp_path / "input.txt"
    path.write_text(f"one\ntwo\n{LONG}\nthree\n")
    n = len(loaded.tokenizer.encode(LONG))
    code, out, err = run_main(["translate", "--checkpoint", str(run), "--input", str(path), "--beam-size", "1"])
    assert code == 1 and "Traceback" not in err
    assert f"error: {path}, line 3: {n} tokens, more than the model takes (15: max_len=16 positions" in err
    assert "the 2 lines before it are translated" in err and len(out.splitlines()) == 2  # and written

    code, out, err = run_main(
        ["translate", "--checkpoint", str(run), "--input", str(path), "--beam-size", "1", "--on-too-long", "truncate"]
    )
    assert code == 0 and len(out.splitlines()) == 4, out + err
    assert "translated 4 lines (4 read, 0 empty); 1 truncated to the model's max_len (lines 3)" in err


def test_translate_names_bad_bytes_by_line(trained, tmp_path):
    run, _ = trained
    path = tmp_path / "input.txt"
    path.write_bytes(b"one\ntw\xffo\n")
    code, out, err = run_main(["translate", "--checkpoint", str(run), "--input", str(path)])
    assert code == 1 and f"error: {path}, line 2: not valid UTF-8: byte 0xff" in err and "Traceback" not in err
    path.write_bytes("one\n".encode("utf-16"))
    code, out, err = run_main(["translate", "--checkpoint", str(run), "--input", str(path)])
    assert code == 1 and "starts with a UTF-16 byte-order mark" in err
    code, out, err = run_main(["translate", "--checkpoint", str(run), "--input", str(tmp_path)])
    assert code == 1 and f"error: {tmp_path}: is a directory, not a text file" in err


@pytest.mark.slow
def test_a_second_translate_loads_its_decoders_from_the_cache(trained, tmp_path):
    """Two `train.py translate` processes with one --compilation-cache folder: the first writes its decoders there,
    as traced (compilation.ProgramStore) and as compiled, the second loads them and writes nothing (no file added or
    rewritten), with the same output (the tiny model's programs compile faster than the threshold, hence 0 here)."""
    import os
    import subprocess

    from jax_transformer import compilation
    from tests.helpers.training import REPO

    run, _ = trained
    text, cache = tmp_path / "input.txt", tmp_path / "xla-cache"
    text.write_text("one\ntwo hundred\nthree thousand and twelve\n")
    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    argv = [sys.executable, str(REPO / "train.py"), "translate", "--checkpoint", str(run), "--input", str(text)]
    outputs, files = [], []
    for _ in range(2):
        done = subprocess.run([*argv, "--compilation-cache", str(cache)], env=env, capture_output=True, text=True)
        assert done.returncode == 0 and "warning" not in done.stderr, done.stdout + done.stderr  # all stored
        outputs.append(done.stdout)
        files.append({str(p.relative_to(cache)): p.stat().st_mtime_ns for p in cache.rglob("*")})
    assert compilation.cache_entries(cache) > 0 and len(outputs[0].splitlines()) == 3
    assert any(name.startswith(f"{compilation.PROGRAMS}/") and name.endswith(".jax_exported") for name in files[0])
    assert files[1] == files[0] and outputs[1] == outputs[0]  # every program loaded, none compiled and written


@pytest.mark.slow
def test_translate_with_int8_weights_quantized_at_load(trained, tmp_path):
    """`--quantize int8`: the weights quantized in memory at load (the checkpoint's files untouched), decoded as the
    Python API decodes the quantized tree; training refuses it."""
    pytest.importorskip("qwix")
    from jax_transformer.model import quantization

    run, loaded = trained
    lines = ["one", "two hundred", "three thousand and twelve"]
    path = tmp_path / "input.txt"
    path.write_text("\n".join(lines) + "\n")
    before = {p: p.stat().st_mtime_ns for p in (run / "checkpoints").rglob("*")}
    code, out, err = run_main(
        ["translate", "--checkpoint", str(run), "--input", str(path), "--beam-size", "2", "--quantize", "int8"]
    )
    assert code == 0, out + err
    assert "(float32, int8)" in err  # how the model computes, said when it is loaded
    qparams, qconfig = quantization.quantized(loaded.params, loaded.config, "int8")
    assert out.splitlines() == translate(qparams, qconfig, loaded.tokenizer, lines, DecodeConfig(beam_size=2))
    assert {p: p.stat().st_mtime_ns for p in (run / "checkpoints").rglob("*")} == before
    code, out, err = run_main(["train", "--resume", str(run), "--steps", "3", "--quantize", "int8"])
    assert code == 1 and "--quantize int8 in training is QLoRA" in err and "Traceback" not in err  # needs adapters


def test_n_best_lists_scores_and_prefixes_on_the_command_line(trained, tmp_path):
    """--n-best with --output-format jsonl and tsv, a prefix column (--input-format tsv): K hypotheses best first,
    each with its score, tokens and per-token log-probs; a prefix's translation begins with it; the best of the
    n-best list is what plain decoding gives."""
    import json

    run, loaded = trained
    path = tmp_path / "input.tsv"
    path.write_text("one\ntwo hundred\tdeux\n\nthree\t\n", encoding="utf-8")
    args = ["translate", "--checkpoint", str(run), "--input", str(path), "--beam-size", "3", "--n-best", "3"]
    code, out, err = run_main([*args, "--input-format", "tsv", "--output-format", "jsonl"])
    assert code == 0, out + err
    assert "decoding: gnmt rules, beam search of 3, alpha 0.6, n_best 3" in err
    records = [json.loads(line) for line in out.splitlines()]
    assert [r["line"] for r in records] == [1, 2, 3, 4] and records[2]["hypotheses"] == []  # the empty line
    assert [r["prefix"] for r in records] == [None, "deux", None, None]
    plain = translate(loaded.params, loaded.config, loaded.tokenizer, ["one", "three"], DecodeConfig(beam_size=3))
    for record, best in zip([records[0], records[3]], plain):
        hypotheses = record["hypotheses"]
        assert len(hypotheses) == 3 and hypotheses[0]["text"] == best
        scores = [h["score"] for h in hypotheses]
        assert scores == sorted(scores, reverse=True)
        assert all(len(h["token_scores"]) >= len(h["tokens"]) for h in hypotheses)  # EOS has a log-prob too
    deux = loaded.tokenizer.encode("deux", side="target")
    for h in records[1]["hypotheses"]:
        assert h["tokens"][: len(deux)] == deux and h["token_scores"][: len(deux)] == [0.0] * len(deux)
        assert h["text"].startswith("deux")
    code, out, err = run_main([*args, "--input-format", "tsv", "--output-format", "tsv"])
    assert code == 0, out + err
    rows = [line.split("\t") for line in out.splitlines()]
    expected = [(str(i), str(k)) for i in (1, 2) for k in (1, 2, 3)] + [("3", "")]  # the empty line: its row
    assert [(r[0], r[1]) for r in rows] == expected + [("4", str(k)) for k in (1, 2, 3)]
    assert [r[3] for r in rows if r[0] == "1"] == [h["text"] for h in records[0]["hypotheses"]]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--beam-size", "2", "--n-best", "3"], "--n-best 3: more than the 2 hypotheses"),
        (["--top-p", "1.5"], "top_p' must be in (0, 1]"),
        (["--do-sample", "--temperature", "0"], "argument --temperature"),
        (["--top-k", "5"], "--top-k (decode field 'top_k') applies to sampling: add --do-sample"),
        (["--do-sample", "--beam-size", "4"], "--beam-size does not apply to sampling"),
        (["--input-format", "tsv", "--max-len-a", "0", "--max-len-b", "2"], "input.tsv, line 1: a target prefix of"),
    ],
)
def test_decoding_choices_are_checked_before_decoding(trained, tmp_path, flags, message):
    run, _ = trained
    path = tmp_path / "input.tsv"
    path.write_text("one\tdeux trois\n", encoding="utf-8")
    code, out, err = run_main(["translate", "--checkpoint", str(run), "--input", str(path), *flags])
    assert code in (1, 2) and message in err, err
    assert out == ""  # nothing decoded, nothing written


def test_a_sample_depends_on_the_seed_and_the_sentence_alone(trained):
    """The same seed draws the same translation of a sentence in any batch; another seed draws others."""
    from jax_transformer.decoding.translation import translations

    _, loaded = trained
    sentences = ["one", "two hundred", "three thousand and five"]
    sample = DecodeConfig(do_sample=True, temperature=3.0, n_best=2, sample_seed=1)
    found = translations(loaded.params, loaded.config, loaded.tokenizer, sentences, sample, progress=False)
    alone = translations(loaded.params, loaded.config, loaded.tokenizer, sentences[2:3], sample, progress=False)
    assert [h.tokens for h in alone[0].hypotheses] == [h.tokens for h in found[2].hypotheses]
    other = translations(
        loaded.params, loaded.config, loaded.tokenizer, sentences, sample.replace(sample_seed=2), progress=False
    )
    texts = lambda ts: [[h.tokens for h in t.hypotheses] for t in ts]  # noqa: E731
    assert texts(other) != texts(found)
    assert any(t.hypotheses[0].tokens != t.hypotheses[1].tokens for t in found)  # two samples, not one twice


def test_score_pairs_on_the_command_line(trained, tmp_path):
    """`train.py score`: one record per input line (an empty side: an empty one), the tokens the target's with EOS,
    the score the sum of the per-token log-probs."""
    import json

    run, loaded = trained
    path = tmp_path / "pairs.tsv"
    path.write_text("one\tun\nseven\t\ntwo\tdeux\n", encoding="utf-8")
    code, out, err = run_main(["score", "--checkpoint", str(run), "--tsv", str(path), "--output-format", "jsonl"])
    assert code == 0, out + err
    records = [json.loads(line) for line in out.splitlines()]
    assert [r["line"] for r in records] == [1, 2, 3] and records[1]["score"] is None
    for record, target in ((records[0], "un"), (records[2], "deux")):
        assert record["tokens"] == loaded.tokenizer.encode(target, side="target") + [loaded.config.eos_id]
        assert record["score"] == pytest.approx(sum(record["token_scores"]), abs=1e-4)
        assert all(v <= 0 for v in record["token_scores"])
    code, text, err = run_main(["score", "--checkpoint", str(run), "--tsv", str(path)])
    assert code == 0 and text.splitlines() == [f"{records[0]['score']:.6g}", "", f"{records[2]['score']:.6g}"]


def test_scores_of_a_decoded_translation_are_the_decoders_log_probs(trained):
    """Teacher forcing (`scoring.token_log_probs`) gives a greedy translation the per-token log-probs the search
    reported for it (1e-5: the cached decoder and the full forward pass sum the same float32 terms in another
    order, a few ulp per layer)."""
    import numpy as np

    from jax_transformer.decoding import decoders, scoring

    _, loaded = trained
    config = loaded.config
    src = np.array([[5, 9, 12, config.eos_id, 0, 0], [7, 8, config.eos_id, 0, 0, 0]], np.int32)
    found = decoders.decoder(config, DecodeConfig(beam_size=1), src.shape[1])(loaded.params, src)
    tokens, expected = found.tokens[:, 0], found.token_scores[:, 0]  # (B, L)
    tgt_in = np.concatenate([np.full((2, 1), config.start_id, np.int32), tokens[:, :-1]], axis=1)
    tgt_in = np.where(tgt_in == config.eos_id, config.pad_id, tgt_in)  # nothing is fed after EOS
    got = np.asarray(scoring.token_log_probs(loaded.params, src, tgt_in, tokens, config=config))
    real = tokens != config.pad_id
    assert real.sum() > 4
    np.testing.assert_allclose(got[real], expected[real], atol=1e-5)
