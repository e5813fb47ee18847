"""Fine-tuning part of a model from the command line: LoRA adapters (`--lora-rank`) and frozen parameters
(`--freeze`) on a run's weights (`--init-from`), what each trains and keeps, the optimiser state only for what
trains, the exports of an adapted run, and the faults refused before any step. (LoRA against peft itself:
parity_tests/test_lora_peft.py.)"""

from __future__ import annotations

import numpy as np
import pytest

from jax_transformer.checkpoint import manager as checkpoint
from jax_transformer.errors import ConfigError
from jax_transformer.interop import peft
from jax_transformer.model import lora
from jax_transformer.model.params import flatten
from jax_transformer.settings.config import OptimConfig, preset
from jax_transformer.training import finetuning
from tests.helpers.training import run_main, tiny_train_args

pytestmark = pytest.mark.slow


def _fine_tune(tiny_run, tmp_path, *flags: str):
    run, corpus = tiny_run
    out = tmp_path / "tuned"
    args = tiny_train_args(out, corpus, steps=2, extra=("--init-from", str(run), *flags))
    # The tiny model's own flags (layers, length) come from the run it starts from.
    for flag in ("--preset", "--num-encoder-layers", "--num-decoder-layers", "--max-len", "--vocab-size"):
        i = args.index(flag)
        del args[i : i + 2]
    code, stdout, stderr = run_main(args)
    return code, stdout, stderr, out


def _params(directory, step="latest"):
    return checkpoint.load(directory, step)


def _moments(state) -> set[tuple[str, ...]]:
    """The parameter paths Adam holds moments for (its state: (count, mu, nu), mu and nu shaped as what trains)."""
    return {p[2:] for p in flatten(state["opt_state"]) if p[1] in ("mu", "nu")}


def test_lora_trains_the_adapters_alone_and_exports_merged(tiny_run, tmp_path):
    code, stdout, stderr, out = _fine_tune(tiny_run, tmp_path, "--lora-rank", "2", "--lora-targets", "q,v,ffn")
    assert code == 0, stdout + stderr
    assert "fine-tuning: LoRA rank 2" in stdout and "trained, the rest frozen" in stdout
    start = flatten(_params(tiny_run[0], "best").params)
    tuned = _params(out)
    flat = flatten(tuned.params)
    adapters = {p for p in flat if p[-1] in lora.ADAPTER_LEAVES}
    # q, v and both feed-forward matrices of the one encoder and one decoder layer (and the cross-attention's q, v)
    assert len(adapters) == 2 * (4 + 6)  # A and B of 4 matrices in the encoder layer, 6 in the decoder layer
    assert all(np.array_equal(flat[p], start[p]) for p in start)  # the base as it was
    assert any(np.abs(flat[p]).max() > 0 for p in adapters if p[-1] == "lora_b")  # B left zero: they trained
    assert _moments(tuned.state) == adapters  # Adam's state: for the adapters only

    code, stdout, stderr = run_main(["export", "--checkpoint", str(out), "--format", "transformers", "--output", "x"])
    assert code == 1 and "--merge-lora" in stderr
    code, stdout, stderr = run_main(["export", "--checkpoint", str(out), "--output", str(tmp_path / "merged.pt")])
    assert code == 1 and "LoRA adapters" in stderr
    merged = tmp_path / "merged.safetensors"
    code, stdout, stderr = run_main(["export", "--checkpoint", str(out), "--merge-lora", "--output", str(merged)])
    assert code == 0, stdout + stderr
    from safetensors.numpy import load_file

    kernel = load_file(str(merged))["encoder.layers.0.self_attention.query.weight"]  # torch's (out, in)
    a, b = (flat[("encoder", "layer_0", "self_attention", "query", k)] for k in ("lora_a", "lora_b"))
    w = start[("encoder", "layer_0", "self_attention", "query", "kernel")]
    np.testing.assert_allclose(kernel.T, w + a @ b * (8.0 / 2), rtol=0, atol=1e-6)
    code, stdout, stderr = run_main(["export", "--checkpoint", str(out), "--format", "peft", "--output", "p"])
    assert code == 1 and "trained here from scratch" in stderr  # peft adapts a transformers model


def test_freeze_leaves_the_named_parameters(tiny_run, tmp_path):
    flags = ("--freeze", "embeddings,encoder", "--schedule", "constant", "--lr", "1e-3")  # warm-up of 20 steps
    code, stdout, stderr, out = _fine_tune(tiny_run, tmp_path, *flags)
    assert code == 0, stdout + stderr
    import json

    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["lr"] for r in records if r["kind"] == "train"] == pytest.approx([0.0, 1e-3 / 20])
    start = flatten(_params(tiny_run[0], "best").params)
    tuned = _params(out)
    flat = flatten(tuned.params)
    moved = {p[0] for p in start if not np.array_equal(flat[p], start[p])}
    assert moved == {"decoder"}
    assert {p[0] for p in _moments(tuned.state)} == {"decoder"}


def test_qlora_trains_adapters_on_an_int8_base_and_translates(tiny_run, tmp_path):
    flags = ("--lora-rank", "2", "--quantize", "int8-weights")
    code, stdout, stderr, out = _fine_tune(tiny_run, tmp_path, *flags)
    assert code == 0, stdout + stderr
    tuned = _params(out)
    kernel = tuned.params["encoder"]["layer_0"]["self_attention"]["query"]["kernel"]
    assert np.asarray(kernel["qvalue"]).dtype == np.int8  # saved as int8 values and their scales
    assert _moments(tuned.state) == {p for p in flatten(tuned.params) if p[-1] in lora.ADAPTER_LEAVES}
    source = tmp_path / "in.txt"
    source.write_text("twelve\nthree hundred\n", encoding="utf-8")
    code, stdout, stderr = run_main(["translate", "--checkpoint", str(out), "--input", str(source)])
    assert code == 0 and len(stdout.splitlines()) == 2, stdout + stderr


@pytest.mark.parametrize(
    "flags, message",
    [
        (("--quantize", "int8-weights"), "QLoRA: the frozen base in int8 under LoRA adapters"),
        (("--add-language", "xyz_Latn"), "has no language codes; new codes are added to NLLB-200's"),
        (("--quantize", "int8-dynamic", "--lora-rank", "2"), "QLoRA takes int8-weights"),
        (("--lora-rank", "500"), "'lora_rank' (500) is larger than the q matrices' smaller dimension (32)"),
        (("--lora-rank", "2", "--lora-targets", "q,attention"), "'lora_targets' ('q,attention')"),
        (("--freeze", "encoder/layer_9"), "--freeze 'encoder/layer_9' names no parameter"),
        (("--freeze", "encoder", "--lora-rank", "2"), "--freeze with --lora-rank"),
        (("--freeze", "*"), "leaves no parameter to train"),
    ],
)
def test_faults_are_named_before_any_step(tiny_run, tmp_path, flags, message):
    code, stdout, stderr, out = _fine_tune(tiny_run, tmp_path, *flags)
    assert code == 1 and message in stderr, stdout + stderr
    assert not (out / "checkpoints").exists()


def test_the_memory_plan_counts_what_trains():
    """`plan`'s trained count and optimiser state follow the mode: LoRA's state is the parameters plus two moments
    of the adapters alone."""
    from jax_transformer.model.sharding import total_bytes
    from jax_transformer.training.trainer import abstract_train_state

    config = preset("tiny", src_vocab_size=64, tgt_vocab_size=64)
    full = total_bytes(abstract_train_state(config, OptimConfig()))
    lora = config.replace(lora_rank=4)
    counts = finetuning.check(lora, None)
    # q and v of 6 attentions (2 encoder layers' self, 2 decoder layers' self and cross), (32, 4) and (4, 32) each
    assert counts["trained"] == 6 * 2 * (32 * 4 + 4 * 32)
    state = total_bytes(abstract_train_state(lora, OptimConfig()))
    full_total = finetuning.check(config, None)["total"]
    # float32 parameters and Adam's two moments (of the adapters alone with LoRA); the scalars (the step, Adam's
    # count, the dropout key) are the same in both
    assert state - full == 4 * (counts["total"] + 2 * counts["trained"]) - 4 * 3 * full_total
    with pytest.raises(ConfigError, match="names no parameter"):
        finetuning.check(config, "decoder/layer_7")


@pytest.mark.parametrize(
    "change, message",
    [
        ({"use_dora": True}, "use_dora=True has no counterpart"),
        ({"target_modules": ["q_proj", "fc1"]}, "one of fc1/fc2 only"),
        ({"target_modules": ["query"]}, "target_modules ['query'] are not among"),
        ({"peft_type": "IA3"}, "only LORA adapters are read"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ],
)
def test_peft_settings_without_a_counterpart_are_refused(change, message):
    from jax_transformer.settings.config import TransformerConfig

    config = TransformerConfig(lora_rank=4, lora_targets="q, v,,ffn")  # read as its entries q, v, ffn
    adapter = peft.peft_config(config, "facebook/nllb-200-distilled-600M")
    assert adapter["target_modules"] == ["fc1", "fc2", "q_proj", "v_proj"]
    assert peft.lora_settings(adapter, "x") == {
        "lora_rank": 4,
        "lora_alpha": 8.0,
        "lora_dropout": 0.0,
        "lora_targets": "q,v,ffn",
    }
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        peft.lora_settings({**adapter, **change}, "adapter_config.json")
