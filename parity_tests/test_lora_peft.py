"""LoRA against the library users know it from: peft's LoraModel on the transformers model a run was imported from
(a tiny random NLLB-200, tests/helpers/multilingual.py), with the same adapters. Logits, training steps, the adapter
written for peft, the merged export and a peft adapter read back.

Tolerances: float32 on both sides, jax at "highest" matmul precision, transformers' eager attention. Logits of
size ~5 differ by summation order only: ~1e-6 seen, 1e-5 asserted (a wrong adapter, scale or transpose moves them by
1e-2 or more). After training steps the adapters are compared to their movement (how far the steps took them)."""

from __future__ import annotations

import functools
import json

import jax
import numpy as np
import pytest

from jax_transformer.interop import hub, peft
from jax_transformer.model import lora
from jax_transformer.model.params import flatten, unflatten
from jax_transformer.model.transformer import Transformer
from jax_transformer.settings.config import OptimConfig
from jax_transformer.training import finetuning, trainer

pytest.importorskip("peft")
torch = pytest.importorskip("torch")

SOURCES = ["one hundred and two", "seven", "forty five thousand and nine"]
TARGETS = ["cent deux", "sept", "quarante-cinq mille neuf"]
# Every matrix peft can adapt in these models (q/k/v/out of both attentions, fc1/fc2), rank 4, alpha 8.
MODULES = ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]
LORA = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=MODULES)
LOGIT_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """(save_pretrained folder of a tiny NLLB model, the project's import of it, the batch in both frameworks)."""
    from tests.helpers.multilingual import TOKENIZERS, model_vocab_size, their_tokenizer, tiny_model

    folder = tmp_path_factory.mktemp("nllb")
    tiny_model("nllb", model_vocab_size("nllb", TOKENIZERS["nllb"](folder))).save_pretrained(folder)
    tokenizer = their_tokenizer(folder, "nllb")
    tokenizer.src_lang, tokenizer.tgt_lang = "eng_Latn", "fra_Latn"
    encoded = tokenizer(SOURCES, text_target=TARGETS, return_tensors="pt", padding=True)
    labels = encoded["labels"]  # (B, T): fra_Latn ... </s>, padded with <pad> 1
    tgt_in = torch.cat([torch.full((len(SOURCES), 1), 2), labels[:, :-1]], 1)  # the decoder starts from </s> (2)
    batch = {
        "src": encoded["input_ids"].numpy().astype(np.int32),
        "tgt_in": tgt_in.numpy().astype(np.int32),
        "tgt_out": labels.numpy().astype(np.int32),
    }
    torch_batch = dict(
        input_ids=encoded["input_ids"],
        attention_mask=encoded["attention_mask"],
        decoder_input_ids=tgt_in,
        labels=labels.masked_fill(labels == 1, -100),  # transformers' ignored label
    )
    return folder, hub.read_pretrained(folder), batch, torch_batch


def peft_model(folder, adapters: dict | None = None, seed: int = 0):
    """transformers' model of `folder` with peft's LoRA (LORA), eval mode (no dropout); its B matrices drawn at
    random (peft starts them at zero, which would hide a wrong B or scale), or set to `adapters` (peft's state)."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from transformers import AutoModelForSeq2SeqLM

    torch.manual_seed(seed)
    model = get_peft_model(
        AutoModelForSeq2SeqLM.from_pretrained(folder, attn_implementation="eager"), LoraConfig(**LORA)
    ).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05)
    if adapters is not None:
        set_peft_model_state_dict(model, {k: torch.tensor(v) for k, v in adapters.items()})
    return model


def their_adapters(model) -> dict[str, np.ndarray]:
    from peft import get_peft_model_state_dict

    return {k: v.detach().numpy().copy() for k, v in get_peft_model_state_dict(model).items()}


def ours_from(imported, model):
    """(config, params): the imported model with the peft model's adapters, read by `finetuning`."""
    adapter = {"peft_type": "LORA", **model.peft_config["default"].to_dict()}
    config = imported.config.replace(**peft.lora_settings(adapter, "peft config"))
    adapters = peft.adapters_from_peft(their_adapters(model), config, "m2m_100", "peft state")
    return config, unflatten({**flatten(imported.params), **adapters})


def logits_of(config, params, batch):
    return np.asarray(Transformer(config).apply({"params": params}, batch["src"], batch["tgt_in"]))


def their_logits(model, torch_batch):
    with torch.no_grad():
        inputs = {k: v for k, v in torch_batch.items() if k != "labels"}
        return model(**inputs).logits.numpy()


def adapters_of(params) -> dict:
    return {p: np.asarray(v) for p, v in flatten(params).items() if p[-1] in lora.ADAPTER_LEAVES}


def test_logits_match_peft(base):
    folder, imported, batch, torch_batch = base
    model = peft_model(folder)
    config, params = ours_from(imported, model)
    assert config.lora_targets == "q,k,v,out,ffn" and config.lora_rank == 4
    ours, theirs = logits_of(config, params, batch), their_logits(model, torch_batch)
    real = batch["tgt_out"] != config.pad_id
    assert np.abs(ours - theirs)[real].max() < LOGIT_TOLERANCE
    # The adapters matter: without them the logits move far beyond the tolerance.
    plain = logits_of(imported.config, imported.params, batch)
    assert np.abs(plain - theirs)[real].max() > 100 * LOGIT_TOLERANCE


def test_training_steps_match_peft(base):
    """Three steps of this project's train step (gradient of the adapters only, the frozen base read as it is)
    against torch's SGD with momentum on the peft model: the update is linear in the gradient, so the adapters
    after the steps agree to the gradients' float32 rounding, 5e-7 of their movement seen, 1e-5 asserted. The base
    does not move."""
    import optax

    folder, imported, batch, torch_batch = base
    model = peft_model(folder)
    config, params = ours_from(imported, model)
    before = adapters_of(params)
    tx = optax.sgd(0.5, momentum=0.9)
    state = trainer.create_train_state(config, OptimConfig(label_smoothing=0.0), params=params)
    state = state.replace(opt_state=tx.init(finetuning.split(state.params, config, None)[0]))
    assert set(flatten(finetuning.split(state.params, config, None)[0])) == set(before)  # the adapters alone
    step = jax.jit(functools.partial(trainer.train_step, config=config, tx=tx, label_smoothing=0.0, dropout=False))
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5, momentum=0.9)
    for _ in range(3):
        state, sums = step(state, batch)
        loss = model(**torch_batch).loss
        assert float(sums["loss"]) / float(sums["tokens"]) == pytest.approx(loss.item(), rel=1e-5)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    theirs = peft.adapters_from_peft(their_adapters(model), config, "m2m_100", "peft state")
    ours = adapters_of(state.params)
    movement = max(np.abs(theirs[p] - before[p]).max() for p in before)
    assert movement > 0.1
    assert max(np.abs(ours[p] - theirs[p]).max() for p in before) <= 1e-5 * movement
    frozen = {p: v for p, v in flatten(state.params).items() if p not in before}
    assert all(np.array_equal(np.asarray(v), np.asarray(flatten(params)[p])) for p, v in frozen.items())


def test_adam_steps_track_peft(base):
    """The run's own optimiser (Adam on the Noam schedule, `make_train_step`) against torch's Adam on the same
    schedule: the losses of three steps agree to 1e-5. (Adam divides each update by the gradient's own size, so an
    adapter entry whose true gradient is zero, such as the key's adapter along a softmax's shift, moves by its
    rounding noise over its rounding noise, differently in each framework: 5e-4 to 2e-3 of the movement seen.)"""
    folder, imported, batch, torch_batch = base
    model = peft_model(folder)
    config, params = ours_from(imported, model)
    opt = OptimConfig(warmup_steps=4, label_smoothing=0.0, b2=0.999, eps=1e-8)
    state = trainer.create_train_state(config, opt, params=params)
    step = trainer.make_train_step(config, opt, dropout=False)
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1.0, betas=(opt.b1, opt.b2))
    rate = lambda s: float(trainer.noam_rate(s + 1, config.d_model, opt.warmup_steps, opt.lr_scale))  # noqa: E731
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, rate)
    losses = []
    for _ in range(3):
        state, sums = step(state, batch)
        loss = model(**torch_batch).loss
        losses.append((float(sums["loss"]) / float(sums["tokens"]), float(loss)))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
    assert losses[-1][1] < losses[0][1] - 0.1  # the steps train
    for ours, theirs in losses:
        assert ours == pytest.approx(theirs, rel=1e-5)


def test_exported_adapter_loads_in_peft_and_merges(base, tmp_path):
    """`export --format peft` of adapters this project holds: peft's PeftModel.from_pretrained on the base gives the
    project's logits; `--merge-lora`'s merged weights give the adapter model's logits; and `import` of the adapter
    directory reads back the same adapters."""
    from peft import PeftModel
    from transformers import AutoModelForSeq2SeqLM

    folder, imported, batch, torch_batch = base
    config, params = ours_from(imported, peft_model(folder, seed=3))
    run = {"imported_from": {"source": str(folder), "family": "m2m_100", **imported.original}}
    path = hub.export_peft(params, config, run, tmp_path / "adapter")
    written = json.loads((path / "adapter_config.json").read_text())
    assert written["base_model_name_or_path"] == str(folder) and written["r"] == 4
    base_model = AutoModelForSeq2SeqLM.from_pretrained(folder, attn_implementation="eager")
    loaded = PeftModel.from_pretrained(base_model, path).eval()
    theirs = their_logits(loaded, torch_batch)
    real = batch["tgt_out"] != config.pad_id
    assert np.abs(logits_of(config, params, batch) - theirs)[real].max() < LOGIT_TOLERANCE

    merged_params, merged_config = lora.merged(params, config)
    assert merged_config.lora_rank == 0
    out, kind = hub.export_transformers(merged_params, merged_config, imported.tokenizer, run, tmp_path / "merged")
    merged = AutoModelForSeq2SeqLM.from_pretrained(out, attn_implementation="eager").eval()
    assert np.abs(their_logits(merged, torch_batch) - theirs)[real].max() < LOGIT_TOLERANCE

    again = hub.read_peft_adapter(path, imported)
    assert again.config == config
    for p, v in adapters_of(params).items():
        np.testing.assert_array_equal(adapters_of(again.params)[p], v)


def test_a_peft_adapter_imports_and_goes_on_training(base, tmp_path):
    """`import ADAPTER_DIR` (peft's files, the base named in them) writes a run that `train --init-from` goes on
    training: the adapters start as the file holds them and move, the base stays, Adam's state is the adapters'.
    An adapter of another base is refused before anything is written: another name, or other shapes."""
    from jax_transformer.checkpoint import manager as checkpoint
    from tests.helpers.training import run_main, write_corpus

    folder, imported, batch, torch_batch = base
    model = peft_model(folder, seed=5)
    model.save_pretrained(tmp_path / "adapter")  # peft's own files
    code, stdout, stderr = run_main(["import", str(tmp_path / "adapter"), "--output", str(tmp_path / "run")])
    assert code == 0, stdout + stderr
    start = checkpoint.load(tmp_path / "run", "best")
    assert start.config.lora_rank == 4 and start.config.lora_targets == "q,k,v,out,ffn"
    theirs = peft.adapters_from_peft(their_adapters(model), start.config, "m2m_100", "peft state")
    assert all(np.array_equal(adapters_of(start.params)[p], v) for p, v in theirs.items())

    corpus = write_corpus(tmp_path)
    args = ["train", "--init-from", str(tmp_path / "run"), "--tsv", str(corpus), "--run-dir", str(tmp_path / "t")]
    args += ["--src-lang", "eng_Latn", "--tgt-lang", "fra_Latn", "--steps", "2", "--max-tokens", "512"]
    args += ["--warmup-steps", "2", "--eval-every", "1000", "--samples", "0", "--no-progress"]
    code, stdout, stderr = run_main(args)
    assert code == 0, stdout + stderr
    tuned = checkpoint.load(tmp_path / "t", "latest")
    flat, before = flatten(tuned.params), flatten(start.params)
    assert all(np.array_equal(flat[p], v) for p, v in before.items() if p not in theirs)  # the base
    assert any(not np.array_equal(flat[p], v) for p, v in theirs.items())  # the adapters moved
    assert {p[2:] for p in flatten(tuned.state["opt_state"]) if p[1] in ("mu", "nu")} == set(theirs)

    code, stdout, stderr = run_main(
        ["import", str(tmp_path / "adapter"), "--base", "facebook/nllb-200-distilled-600M", "--output", "x"]
    )
    assert code == 1 and "trained on" in stderr and "nllb-200-distilled-600M" in stderr
    settings = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps({**settings, "r": 8}))  # not its weights
    code, stdout, stderr = run_main(["import", str(tmp_path / "adapter"), "--output", str(tmp_path / "y")])
    assert code == 1 and "does not fit this base model" in stderr and "lora_A.weight: shape (4, 32)" in stderr
    assert not (tmp_path / "y").exists()


def test_an_adapter_imports_onto_the_run_import_wrote(base, tmp_path):
    """`import ADAPTER --base RUN`, RUN the run directory `import` wrote from the adapter's base model (the thing a
    user has at hand), gives the run `--base` of the base's own folder gives, read from disk alone; a run trained
    here from scratch is refused, naming why."""
    from jax_transformer.checkpoint import manager as checkpoint
    from tests.helpers.saved import saved_run
    from tests.helpers.training import run_main

    folder = base[0]
    peft_model(folder, seed=3).save_pretrained(tmp_path / "adapter")
    code, stdout, stderr = run_main(["import", str(folder), "--output", str(tmp_path / "base-run")])
    assert code == 0, stdout + stderr
    for name, given in (("by-run", tmp_path / "base-run"), ("by-folder", folder)):
        code, stdout, stderr = run_main(
            ["import", str(tmp_path / "adapter"), "--base", str(given), "--output", str(tmp_path / name)]
        )
        assert code == 0, stdout + stderr
    by_run, by_folder = (checkpoint.load(tmp_path / name, "best") for name in ("by-run", "by-folder"))
    assert by_run.config == by_folder.config and by_run.config.lora_rank == 4
    a, b = flatten(by_run.params), flatten(by_folder.params)
    assert a.keys() == b.keys() and all(np.array_equal(a[p], b[p]) for p in a)
    assert by_run.run == by_folder.run  # the same base name, family, adapter and decoding

    scratch = saved_run(tmp_path / "scratch")
    code, stdout, stderr = run_main(
        ["import", str(tmp_path / "adapter"), "--base", str(scratch), "--output", str(tmp_path / "z")]
    )
    assert code == 1 and "a run trained here from scratch" in stderr and not (tmp_path / "z").exists()
