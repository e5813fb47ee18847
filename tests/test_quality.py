"""The quality tools: early stopping, checkpoint averaging, the decoding sweep and the sacreBLEU
signature of `evaluate`, `verify` (a trained checkpoint against its PyTorch twin), the BLEU-against-minutes plot
and named recipes. Everything through train.py where people use it through train.py, on the one-layer tiny
model of tests/helpers/training.py (runs in one process share their compiled steps)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal

import jax
import numpy as np
import pytest

from jax_transformer.checkpoint import manager as ckpt_lib
from jax_transformer.checkpoint.averaging import average_checkpoints, average_params
from jax_transformer.data.default_task import number_pair
from jax_transformer.data.tokenizer import Tokenizer
from jax_transformer.decoding.evaluation import score_translations
from jax_transformer.model.transformer import init_params
from jax_transformer.settings import config as config_lib
from jax_transformer.training import run as run_lib
from jax_transformer.training import trainer
from tests.helpers.configs import unit_config, unit_optim
from tests.helpers.training import N_TRAIN, run_main, tiny_train_args, write_corpus
from tests.helpers.twins import flat

# --- early stopping ---------------------------------------------------------------------------------------------

EVAL_EVERY, PATIENCE, BUDGET = 3, 3, 60


def _eval_records(run_dir, final: bool = False) -> list[dict]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["kind"] == "eval" and bool(r["final"]) == final]


def fairseq_stop_step(losses: dict[int, float], patience: int) -> int | None:
    """Where fairseq's should_stop_early stops, given the validation loss of each evaluation step (lower is
    better): the evaluation at which `patience` evaluations in a row have not beaten the best strictly."""
    best, bad = None, 0
    for step in sorted(losses):
        if best is None or losses[step] < best:
            best, bad = losses[step], 0
        else:
            bad += 1
        if bad >= patience:
            return step
    return None


@pytest.fixture(scope="module")
def early_stopped(tmp_path_factory):
    """Validation = the training pairs reversed (French -> English): as the model learns English -> French, its
    loss on English targets rises after the first evaluations, so --patience stops the run long before the step
    budget. One run straight through; two interrupted and resumed: at step 6 (an evaluation step: its evaluation
    is counted once, before the final report) and at step 7 (not one: the final evaluation's selection score must
    not count)."""
    root = tmp_path_factory.mktemp("early")
    train = write_corpus(root)
    valid = root / "valid.tsv"
    lines = train.read_text(encoding="utf-8").splitlines()[:40]
    valid.write_text("".join("\t".join(reversed(line.split("\t"))) + "\n" for line in lines), encoding="utf-8")
    flags = ("--eval-every", str(EVAL_EVERY), "--patience", str(PATIENCE), "--best-metric", "loss")
    runs = {"straight": run_main(tiny_train_args(root / "straight", train, steps=BUDGET, valid=valid, extra=flags))}
    for stop in (6, 7):
        run_dir = root / f"stopped_at_{stop}"
        first = run_main(tiny_train_args(run_dir, train, steps=stop, valid=valid, extra=flags))
        resumed = run_main(["train", "--resume", str(run_dir), "--steps", str(BUDGET), "--no-progress"])
        runs[f"stopped_at_{stop}"] = (first, resumed)
    # A SIGINT right after step 6, before its evaluation: the run saves step 6 unevaluated and exits; the resumed
    # run must make that evaluation up before its first step.
    run_dir = root / "interrupted_at_6"
    real_prepare = run_lib.prepare

    def interrupt_after_step_6(step, drain):
        if step == 6:
            os.kill(os.getpid(), signal.SIGINT)  # caught by the loop's StopSignals handler

    def prepare_with_hook(**arguments):
        return dataclasses.replace(real_prepare(**arguments), on_step=interrupt_after_step_6)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(run_lib, "prepare", prepare_with_hook)
        first = run_main(tiny_train_args(run_dir, train, steps=BUDGET, valid=valid, extra=flags))
    runs["evaluated_before_the_signal"] = [r["step"] for r in _eval_records(run_dir)]
    resumed = run_main(["train", "--resume", str(run_dir), "--no-progress"])
    runs["interrupted_at_6"] = (first, resumed)
    return root, runs


@pytest.mark.slow
def test_patience_stops_where_fairseqs_rule_says(early_stopped):
    root, runs = early_stopped
    code, out, err = runs["straight"]
    assert code == 0, out + err
    losses = {r["step"]: r["valid_loss"] for r in _eval_records(root / "straight")}
    expected = fairseq_stop_step(losses, PATIENCE)
    assert expected is not None and expected < BUDGET  # the case really stops early
    assert sorted(losses) == list(range(EVAL_EVERY, expected + 1, EVAL_EVERY))  # and evaluates no further
    assert f"done: step {expected} (patience)" in out
    # The best checkpoint is the evaluation with the lowest loss; the final message and `load` agree on it.
    best = min(losses, key=losses.get)
    assert f"best step {best} (by validation loss)" in out
    assert ckpt_lib.load(root / "straight").step == best
    saved = ckpt_lib.load(root / "straight", "latest")
    assert saved.step == expected
    assert saved.loop_state["early_stopping"] == {
        "best_score": pytest.approx(-losses[best]),
        "best_step": best,
        "bad_evals": PATIENCE,
        "last_eval_step": expected,
        "last_score": pytest.approx(-losses[expected]),
    }


@pytest.mark.parametrize("case", ["stopped_at_6", "stopped_at_7", "interrupted_at_6"])
def test_resumed_run_stops_at_the_same_step(early_stopped, case):
    root, runs = early_stopped
    (code, out, err), (code2, out2, err2) = runs[case]
    if case.startswith("interrupted"):
        assert code == 130 and "stopped by SIGINT at step 6" in out, out + err
        assert runs["evaluated_before_the_signal"] == [3]  # step 6 was left for the resumed run
    else:
        assert code == 0, out + err
        assert f"done: step {case[-1]} (steps)" in out
    assert code2 == 0, out2 + err2
    straight_out = runs["straight"][1]
    stopped = re.search(r"done: step (\d+) \(patience\)", straight_out).group(1)
    assert f"done: step {stopped} (patience)" in out2
    # The same evaluations, each once, counted the same way, and bit-identical final parameters (the resume is
    # exact).
    straight = [(r["step"], r["valid_loss"], r["bad_evals"]) for r in _eval_records(root / "straight")]
    resumed = [(r["step"], r["valid_loss"], r["bad_evals"]) for r in _eval_records(root / case)]
    assert resumed == straight
    a = flat(ckpt_lib.load(root / "straight", "latest").params)
    b = flat(ckpt_lib.load(root / case, "latest").params)
    assert all(np.array_equal(a[k], b[k]) for k in a)


def test_resume_keeps_the_best_metric_and_the_recipe(early_stopped):
    root, _ = early_stopped
    code, out, err = run_main(["train", "--resume", str(root / "straight"), "--best-metric", "bleu", "--no-progress"])
    assert code == 1 and "best_metric='loss'" in err and "best_metric='bleu'" in err and "Traceback" not in err
    code, out, err = run_main(["train", "--resume", str(root / "straight"), "--recipe", "multi30k", "--no-progress"])
    assert code == 1 and "started with recipe None" in err and "leave out --recipe" in err


def test_patience_must_be_positive(tmp_path):
    code, out, err = run_main(
        tiny_train_args(tmp_path / "run", write_corpus(tmp_path), steps=1, extra=("--patience", "0"))
    )
    assert code == 2 and "argument --patience: loop field 'patience' must be an int >= 1" in err


# --- a trained run with validation BLEU, shared by averaging, evaluate, verify ---------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """40 steps with held-out validation numbers (BLEU on 20 sentences every 20 steps), checkpoints every 10
    steps, the last 4 kept."""
    root = tmp_path_factory.mktemp("trained")
    train = write_corpus(root)
    valid = root / "valid.tsv"
    valid.write_text("".join("\t".join(number_pair(n)) + "\n" for n in range(N_TRAIN, N_TRAIN + 24)))
    extra = ("--save-every", "10", "--keep", "4", "--eval-every", "20", "--eval-sentences", "20")
    code, out, err = run_main(tiny_train_args(root / "run", train, steps=40, valid=valid, extra=extra))
    assert code == 0, out + err
    return root, out


@pytest.mark.slow
def test_training_stores_the_sacrebleu_signature(trained):
    root, out = trained
    records = _eval_records(root / "run") + _eval_records(root / "run", final=True)
    assert [r["step"] for r in records] == [20, 40, 40]
    for record in records:
        assert record["bleu_signature"].startswith("nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:")
        assert "case:lc|eff:no|tok:13a" in record["bleu_lc_signature"]
    assert "sacreBLEU nrefs:1|case:mixed" in out  # the final report prints it


def test_lowercased_bleu_is_the_tutorials_variant():
    scores = score_translations(["A man, in a blue shirt, runs."], ["a man , in a blue shirt , runs ."])
    assert scores["bleu_lc"] == pytest.approx(100.0)  # lowercased and 13a-tokenized: the same tokens
    assert scores["bleu"] < 95.0  # cased: "A" is not "a", so 1 of 12 unigrams (and 3 higher n-grams) miss


# --- checkpoint averaging ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.train([f"w{i} v{i % 7} u{i % 3}" for i in range(300)], 40, model_type="bpe")


def _save_params(directory, steps_params, tokenizer):
    """Checkpoints of the unit config whose parameters are given: {step: params}."""
    manager = ckpt_lib.CheckpointManager(directory, keep=len(steps_params))
    state = trainer.create_train_state(unit_config(), unit_optim())
    for step, params in steps_params.items():
        saved = trainer.state_for_saving(state.replace(params=params))
        manager.save(step, saved, config=unit_config(), optim=unit_optim().to_dict(), tokenizer=tokenizer)
    manager.close()


def test_average_of_identical_checkpoints_is_that_checkpoint(tmp_path, tokenizer):
    """Bit-exact: the float64 sum of K copies of a float32 value is exact (24 + log2(K) bits < 53), and dividing
    it by K gives that value exactly, which float32 represents."""
    params = init_params(unit_config(), seed=3)
    _save_params(tmp_path / "run" / "checkpoints", {2: params, 4: params, 6: params}, tokenizer)
    output, step, steps = average_checkpoints(tmp_path / "run", 3, tmp_path / "avg", print_fn=lambda s: None)
    assert (step, steps) == (6, [2, 4, 6])
    loaded = ckpt_lib.load(output)
    assert loaded.step == 6 and loaded.config == unit_config()
    assert loaded.tokenizer.to_bytes() == tokenizer.to_bytes()
    before, after = flat(jax.device_get(params)), flat(loaded.params)
    assert before.keys() == after.keys()
    for key in before:
        assert after[key].dtype == np.float32 and np.array_equal(after[key], before[key]), key
    assert loaded.run["averaged_from"]["steps"] == [2, 4, 6] and "opt_state" not in loaded.state


def test_average_of_two_checkpoints_is_their_mean(tmp_path, tokenizer):
    """Each element is the float32 nearest to the exact mean: within half a float32 ulp of it (a + b is exact in
    float64 for float32 values of nearby exponents, as these are, and halving is exact; one rounding remains).
    The last 2 of 3 saved steps are averaged: step 1 must not enter."""
    a, b = init_params(unit_config(), seed=1), init_params(unit_config(), seed=2)
    junk = jax.tree_util.tree_map(lambda p: p + 100.0, a)
    _save_params(tmp_path / "run" / "checkpoints", {1: junk, 5: a, 9: b}, tokenizer)
    output, step, steps = average_checkpoints(tmp_path / "run", 2, tmp_path / "avg", print_fn=lambda s: None)
    assert steps == [5, 9]
    mean = flat(ckpt_lib.load(output).params)
    fa, fb = flat(jax.device_get(a)), flat(jax.device_get(b))
    worst = 0.0
    for key in fa:
        exact = (fa[key].astype(np.float64) + fb[key].astype(np.float64)) / 2
        error = np.abs(mean[key].astype(np.float64) - exact)
        half_ulp = np.spacing(np.abs(mean[key])).astype(np.float64) / 2
        assert np.all(error <= half_ulp), key
        worst = max(worst, float(np.max(np.abs(mean[key] - fa[key]))))
    assert worst > 1e-3  # the two really differ: the mean is not trivially one of them
    # average_params on its own: the same, and a structure mismatch is refused.
    assert all(np.array_equal(flat(average_params([a, b]))[k], mean[k]) for k in mean)
    with pytest.raises(ValueError, match="differs in structure"):
        average_params([a, {"other": np.zeros(3)}])


def test_average_bad_input_is_reported_cleanly(tmp_path, tokenizer):
    params = init_params(unit_config(), seed=0)
    _save_params(tmp_path / "run" / "checkpoints", {1: params, 2: params}, tokenizer)
    cases = [
        (["--checkpoint", str(tmp_path / "run"), "--last", "5"], ["--last 5", "the 2 saved", "--keep 5"]),
        (["--checkpoint", str(tmp_path / "nope"), "--last", "2"], ["nope", "no such run directory"]),
        (["--checkpoint", str(tmp_path / "run"), "--last", "0"], ["argument --last: must be an int >= 1, got 0"]),
    ]
    for flags, pieces in cases:
        code, out, err = run_main(["average", *flags, "--output", str(tmp_path / "avg")])
        parse_error = flags[-2:] == ["--last", "0"]  # out of the flag's range: argparse's exit 2
        assert code == (2 if parse_error else 1) and "Traceback" not in err, err
        for piece in pieces:
            assert piece in err, (piece, err)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("keep me")
    code, out, err = run_main(
        ["average", "--checkpoint", str(tmp_path / "run"), "--last", "2", "--output", str(tmp_path / "full")]
    )
    assert code == 1 and "already exists and is not empty" in err
    assert (tmp_path / "full" / "x").read_text() == "keep me"


@pytest.mark.slow
def test_averaged_run_is_read_like_a_run_and_cannot_be_resumed(trained, tmp_path):
    root, _ = trained
    code, out, err = run_main(
        ["average", "--checkpoint", str(root / "run"), "--last", "3", "--output", str(tmp_path / "avg")]
    )
    assert code == 0, out + err
    assert "steps [20, 30, 40]" in out
    code, out, err = run_main(["evaluate", "--checkpoint", str(tmp_path / "avg"), "--beam-size", "1", "--samples", "0"])
    assert code == 0, out + err
    assert json.loads(out.splitlines()[-1])["sentences"] == 24  # the run's own validation data
    code, out, err = run_main(["export", "--checkpoint", str(tmp_path / "avg"), "--output", str(tmp_path / "m.pt")])
    assert code == 0 and (tmp_path / "m.pt").is_file(), out + err
    code, out, err = run_main(["train", "--resume", str(tmp_path / "avg"), "--no-progress"])
    assert code == 1 and "average of checkpoints" in err and "cannot continue a run" in err and "Traceback" not in err


# --- evaluate: several decodings, signature ----------------------------------------------------------------------


@pytest.mark.slow
def test_evaluate_sweeps_beam_and_alpha(trained):
    root, _ = trained
    base = ["evaluate", "--checkpoint", str(root / "run"), "--samples", "0"]
    code, out, err = run_main([*base, "--beam-size", "1", "2", "--alpha", "0.6", "1.5"])
    assert code == 0, out + err
    result = json.loads(out.splitlines()[-1])
    grid = [(row["beam_size"], row["alpha"]) for row in result["sweep"]]
    assert grid == [(1, 0.6), (2, 0.6), (2, 1.5)]  # greedy once: alpha does not enter it
    assert result["best"]["bleu"] == max(row["bleu"] for row in result["sweep"])
    assert out.count("| 2 | ") == 2 and "| 1 | - |" in out  # the table
    assert "sacreBLEU signatures: BLEU nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:" in out
    assert "lowercased BLEU: nrefs:1|case:lc|eff:no|tok:13a" in out
    # One setting alone gives the figures of its row in the table.
    code, out, err = run_main([*base, "--beam-size", "2", "--alpha", "1.5"])
    assert code == 0, out + err
    single = json.loads(out.splitlines()[-1])
    assert single["bleu"] == result["sweep"][2]["bleu"] and single["chrf"] == result["sweep"][2]["chrf"]
    assert single["bleu_signature"] == result["sweep"][0]["bleu_signature"]


# --- verify -------------------------------------------------------------------------------------------------------


@pytest.fixture
def torch_threads_restored():
    """`verify` sets torch's thread count for its process (--torch-threads, default 1); later tests get theirs back."""
    import torch

    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
def test_verify_a_trained_checkpoint_against_its_pytorch_twin(trained, tmp_path, torch_threads_restored):
    root, _ = trained
    report_path = tmp_path / "verify.json"
    code, out, err = run_main(
        ["verify", "--checkpoint", str(root / "run"), "--beam-size", "3", "--json", str(report_path), "--no-progress"]
    )
    assert code == 0, out + err
    report = json.loads(report_path.read_text())
    assert report["sentences"] == 24 and report["target_tokens"] > 24
    # float32 in both, differing in summation order only: measured 7.6e-6 on logits up to ~6 (16 float32 ulps
    # there), each framework within 5.4e-6 of the float64 twin. 5e-5 leaves room for another CPU's kernels; a
    # wrong weight or mask moves logits by 1e-2 or more. And both sides are as close to float64 as to each other.
    assert report["logit_max_abs_diff"] <= 5e-5
    assert max(report["flax_vs_float64"], report["torch_vs_float64"]) <= 5e-5
    assert [d["name"] for d in report["decodings"]] == ["greedy", "beam 3 (alpha 0.6)"]
    for decoding in report["decodings"]:
        # A token may only flip at a near tie (log-probs agree to ~1e-6): every greedy mismatch must show one.
        assert all(m["gap"] is None or m["gap"] < 1e-4 for m in decoding["mismatches"])
        assert decoding["identical"] + len(decoding["mismatches"]) == 24
        if not decoding["mismatches"]:  # identical tokens give identical text and scores
            assert decoding["scores"]["flax"] == decoding["scores"]["torch"]
    assert sum(d["identical"] for d in report["decodings"]) >= 46  # at most two flips in 48 decodings
    assert "teacher forcing: largest |logit difference|" in out and "| greedy |" in out and "verified" in out
    # A tolerance below what was measured fails with its own exit code.
    code, out, err = run_main(
        ["verify", "--checkpoint", str(root / "run"), "--beam-size", "1", "--sentences", "4", "--logit-tolerance", "0"]
    )
    if report["logit_max_abs_diff"] > 0:
        assert code == 4 and "the frameworks differ" in err


@pytest.mark.slow
def test_evaluate_and_verify_with_int8_weights(trained, tmp_path, torch_threads_restored):
    """`evaluate --quantize int8` scores the int8 model; `verify --quantize int8` puts it against the float32 twin:
    the logits now differ by quantization's error, far beyond float32 rounding (the twin stays within float32 of
    float64, the int8 side does not)."""
    pytest.importorskip("qwix")
    root, _ = trained
    code, out, err = run_main(
        ["evaluate", "--checkpoint", str(root / "run"), "--beam-size", "1", "--samples", "0", "--quantize", "int8"]
    )
    assert code == 0 and "(float32, int8)" in err, out + err
    assert 0 <= json.loads(out.splitlines()[-1])["bleu"] <= 100
    report_path = tmp_path / "verify.json"
    argv = ["verify", "--checkpoint", str(root / "run"), "--beam-size", "1", "--sentences", "4", "--quantize", "int8"]
    code, out, err = run_main([*argv, "--logit-tolerance", "1", "--json", str(report_path), "--no-progress"])
    assert code == 0, out + err
    report = json.loads(report_path.read_text())
    assert report["quantize"] == "int8" and "Flax quantized (int8)" in out
    assert report["torch_vs_float64"] <= 5e-5 < report["flax_vs_float64"]  # the twin float32, the Flax side int8
    assert 1e-4 < report["logit_max_abs_diff"] < 0.2 * report["logit_max_abs"]
    # The quality benchmark on the same run: BLEU, identical translations and logits, float32 against int8
    from benchmarks import int8_quality

    quality = tmp_path / "quality.json"
    argv = ["--run", str(root / "run"), "--sentences", "6", "--beams", "1", "--modes", "int8-dynamic"]
    assert int8_quality.main([*argv, "--json", str(quality)]) == 0
    (row,) = json.loads(quality.read_text())["results"]
    assert row["sentences"] == 6 and 0 <= row["identical"] <= 6 and 0 < row["logit_max_abs_diff"] < row["logit_max_abs"]


# --- the plot -----------------------------------------------------------------------------------------------------


def test_plot_runs_against_wall_clock_minutes(tmp_path):
    """Two runs; the second resumed once (its clock restarts), so its minutes continue from 12 minutes on."""
    from jax_transformer.training.curves import run_curve

    def write(path, records):
        path.mkdir()
        (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))

    ev = lambda step, s, bleu, loss, final=False: dict(
        kind="eval", step=step, elapsed_s=s, bleu=bleu, valid_loss=loss, final=final, beam_size=4, sentences=10
    )
    tr = lambda step, s: dict(kind="train", step=step, elapsed_s=s, loss=3.0)
    write(
        tmp_path / "old", [tr(1, 30), ev(100, 300, 10.0, 4.0), ev(200, 600, 15.0, 3.5), ev(200, 660, 17.0, 3.5, True)]
    )
    write(tmp_path / "new", [ev(100, 360, 12.0, 3.9), ev(200, 720, 20.0, 3.2), tr(201, 40), ev(300, 300, 25.0, 3.0)])
    curve = run_curve(tmp_path / "new")
    assert curve.minutes == [6.0, 12.0, 17.0] and curve.bleu == [12.0, 20.0, 25.0] and curve.final is None
    old = run_curve(tmp_path / "old")
    assert old.minutes == [5.0, 10.0] and old.final["minutes"] == 11.0
    code, out, err = run_main(
        [
            "plot",
            "--runs",
            str(tmp_path / "old"),
            str(tmp_path / "new"),
            "--labels",
            "old",
            "new",
            "--output",
            str(tmp_path / "q.png"),
        ]
    )
    assert code == 0, out + err
    assert (tmp_path / "q.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "old: 2 evaluations; final BLEU 17.00 at 11.0 min" in out
    code, out, err = run_main(["plot", "--runs", str(tmp_path / "missing"), "--output", str(tmp_path / "x.png")])
    assert code == 1 and "missing" in err and "no metrics.jsonl" in err


# --- recipes -----------------------------------------------------------------------------------------------------


def test_recipes_fill_what_is_not_given(tmp_path):
    from jax_transformer.settings.config import DataConfig, LoopConfig, OptimConfig
    from jax_transformer.training import run

    for name, recipe in config_lib.RECIPES.items():  # every recipe names real fields with valid values
        DataConfig.from_dict(recipe.get("data", {}), source=name)
        OptimConfig.from_dict(recipe.get("optim", {}), source=name)
        LoopConfig.from_dict(recipe.get("loop", {}), source=name)
    from jax_transformer.settings.resolve import DEFAULT_RECIPE

    assert DEFAULT_RECIPE["files"] is None  # data files keep the dataclass defaults until one is measured

    train = write_corpus(tmp_path)
    prepared = run.prepare(
        run_dir=tmp_path / "run",
        recipe="multi30k",
        preset_name="tiny",  # given: wins over the recipe's "small"
        data={"tsv": str(train), "vocab_size": 100, "tokenizer_type": "bpe"},  # the vocabulary too
        loop={"steps": 0, "progress": False},
        print_fn=lambda s: None,
    )
    run.close(prepared)
    recipe = config_lib.RECIPES["multi30k"]
    assert prepared.settings["recipe"] == "multi30k" and prepared.settings["preset"] == "tiny"
    assert prepared.config.d_model == 32 and prepared.config.src_vocab_size <= 100
    assert prepared.settings["data"]["max_tokens"] == recipe["data"]["max_tokens"]
    assert prepared.optim.warmup_steps == recipe["optim"]["warmup_steps"] and prepared.optim.clip_norm == 1.0
    assert prepared.loop.eval_sentences == recipe["loop"]["eval_sentences"] and prepared.loop.steps == 0
    with pytest.raises(run.ConfigError, match="unknown recipe 'nope'"):
        run.prepare(run_dir=tmp_path / "other", recipe="nope", print_fn=lambda s: None)

    # A recipe in a JSON file, as one is tried before it earns a name: it fills what the flags leave out.
    recipe_file = tmp_path / "trial.json"
    trial = {"about": "a trial", "optim": {"warmup_steps": 123, "label_smoothing": 0.2}, "loop": {"keep": 2}}
    recipe_file.write_text(json.dumps(trial))
    code, out, err = run_main(tiny_train_args(tmp_path / "trial", train, steps=0, extra=("--recipe", str(recipe_file))))
    assert code == 0, out + err
    stored = ckpt_lib.load(tmp_path / "trial", "latest")
    assert stored.optim["label_smoothing"] == 0.2 and stored.run["loop"]["keep"] == 2  # from the recipe
    assert stored.optim["warmup_steps"] == 20  # given by tiny_train_args: flags win over the recipe
    assert stored.run["recipe"] == str(recipe_file)
    recipe_file.write_text(json.dumps({"optim": {"warmup": 5}}))
    code, out, err = run_main(tiny_train_args(tmp_path / "bad", train, steps=0, extra=("--recipe", str(recipe_file))))
    assert code == 1 and str(recipe_file) in err and "'optim'" in err and "warmup" in err and "Traceback" not in err


# --- the twin's training curve (benchmarks/twin_curve.py) ---------------------------------------------------------


@pytest.mark.slow
def test_twin_curve_script_runs(tmp_path):
    """Three steps on the built-in task, no baselines, in a child process (the script sets torch's thread count and
    jax's precision for its whole process). The loss curves agree as the training parity test requires after three
    steps (relative 1e-5: forward passes agree to ~1e-6, see parity_tests/test_training_parity.py)."""
    import subprocess
    import sys

    from tests.helpers.training import REPO

    out = tmp_path / "curve.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / "twin_curve.py"), "--steps", "3", "--data", "none", "--checks"]
    cmd += ["--rows", "8", "--width", "24", "--output", str(tmp_path / "curve.png"), "--json", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())["twin"]
    assert len(result["loss_a"]) == len(result["loss_b"]) == len(result["relative_gap"]) == 3
    assert result["largest_relative_gap"] <= 1e-5
    assert (tmp_path / "curve.png").read_bytes()[:4] == b"\x89PNG"
    assert "largest relative gap of the loss curves" in proc.stdout
