"""`serve --models`: several models behind one address. The trained tiny run (en-fr), a tiny random NLLB import
serving the two pairs its entry lists and a tiny random M2M-100 import serving one: each pair answers as `translate`
of its own checkpoint does, /languages lists every pair, the native API names a model, and two entries claiming one
pair are refused at start unless the file says which serves it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jax_transformer.errors import ConfigError
from tests.test_serve import SENTENCES, Server

pytest.importorskip("starlette")
pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # (a server in a child process, two imports)

FLAGS = ["--beam-size", "1", "--max-tokens", "32"]  # greedy, a small budget: few programs to compile at start


def _import(family: str, folder: Path) -> Path:
    from jax_transformer.interop import hub
    from tests.helpers.multilingual import TOKENIZERS, model_vocab_size, tiny_model

    tiny_model(family, model_vocab_size(family, TOKENIZERS[family](folder / "hf")), seed=3).save_pretrained(
        folder / "hf"
    )
    return hub.import_model(folder / "hf", folder / "run", print_fn=lambda line: None)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from tests.helpers.saved import saved_run

    base = tmp_path_factory.mktemp("models")
    return {
        "numbers": saved_run(base / "numbers"),
        "nllb": _import("nllb", base / "nllb"),
        "m2m": _import("m2m100", base / "m2m"),
    }


def _file(folder: Path, models: list[dict], **more) -> Path:
    path = folder / "models.json"
    path.write_text(json.dumps({"models": models, **more}), encoding="utf-8")
    return path


def _translate(run: Path, sentences: list[str], folder: Path, *languages: str) -> list[str]:
    from tests.helpers.training import run_main

    source = folder / "source.txt"
    source.write_text("".join(s + "\n" for s in sentences), encoding="utf-8")
    flags = ["--src-lang", languages[0], "--tgt-lang", languages[1]] if languages else []
    code, out, err = run_main(["translate", "--checkpoint", str(run), "--step", "latest", "--input", str(source),
                               *FLAGS[:2], *flags])  # fmt: skip
    assert code == 0, err
    return out.splitlines()


def test_each_pair_answers_as_translate_of_its_own_checkpoint(runs, tmp_path):
    models = [
        {"name": "numbers", "checkpoint": str(runs["numbers"]), "step": "latest"},
        {"name": "nllb", "checkpoint": str(runs["nllb"]), "step": "latest", "pairs": ["en-de", "deu_Latn-en"]},
        {"name": "m2m", "checkpoint": str(runs["m2m"]), "step": "latest", "pairs": ["fr-de"]},
    ]
    server = Server(["--models", str(_file(tmp_path, models)), *FLAGS])
    try:
        text = SENTENCES[:3]
        cases = {
            ("en", "fr"): _translate(runs["numbers"], text, tmp_path),
            ("en", "de"): _translate(runs["nllb"], text, tmp_path, "eng_Latn", "deu_Latn"),
            ("de", "en"): _translate(runs["nllb"], text, tmp_path, "deu_Latn", "eng_Latn"),
            ("fr", "de"): _translate(runs["m2m"], text, tmp_path, "fr", "de"),
        }
        for (source, target), expected in cases.items():
            status, answer = server.request("/translate", {"q": text, "source": source, "target": target})
            assert status == 200 and answer["translatedText"] == expected, (source, target, answer)
        status, listing = server.request("/languages", method="GET")
        assert {entry["code"]: entry["targets"] for entry in listing} == {"en": ["fr", "de"], "de": ["en"],
                                                                          "fr": ["de"]}  # fmt: skip
        # The native API may name the model; a pair no model serves is a 400 naming the pairs there are.
        status, answer = server.request("/v1/translate", {"text": text, "model": "m2m", "source": "fr", "target": "de"})
        assert status == 200 and answer["model"] == "m2m"
        assert [t["text"] for t in answer["translations"]] == cases[("fr", "de")]
        status, answer = server.request("/translate", {"q": "one", "source": "fr", "target": "en"})
        assert status == 400 and "no model here translates fr to en (pairs: en-fr, en-de, de-en, fr-de)" in answer[
            "error"]  # fmt: skip
        status, answer = server.request(
            "/v1/translate", {"text": "one", "model": "nope", "source": "en", "target": "fr"}
        )
        assert status == 400 and "model 'nope' is not served here (models: numbers, nllb, m2m)" in answer["error"]
        status, health = server.request("/health", method="GET")
        assert set(health["models"]) == {"numbers", "nllb", "m2m"} and health["compilations_after_ready"] == 0
        log = "".join(server.log)
        assert all(f"model {name}: " in log and "MiB of weights" in log for name in ("numbers", "nllb", "m2m"))
    finally:
        assert server.stop() == 0, "".join(server.log)


def test_two_models_claiming_one_pair_are_refused_unless_the_file_prefers_one(runs):
    from jax_transformer.decoding.translator import Translator
    from jax_transformer.serving import service
    from jax_transformer.settings.config import ServeConfig

    numbers = service.Entry("numbers", Translator(runs["numbers"], "latest"), None, "models[0]")
    nllb = service.Entry("nllb", Translator(runs["nllb"], "latest"), None, "models[1]")  # all its pairs: en-fr too
    with pytest.raises(ConfigError, match="en-fr is served by two models, 'numbers' and 'nllb'"):
        service.build([numbers, nllb], ServeConfig(), detect=False)
    found = service.build([numbers, nllb], ServeConfig(), prefer={"en-fr": "numbers"}, detect=False)
    assert found.routes[("en", "fr")].name == "numbers" and found.routes[("fr", "en")].name == "nllb"


@pytest.mark.parametrize(
    "content, message",
    [
        ({"models": []}, 'expected {"models": '),
        ({"models": [{"name": "a"}]}, r"models\[0\].checkpoint: expected a run directory"),
        ({"models": [{"name": "a", "checkpoint": "nowhere"}]}, "models.0..checkpoint 'nowhere': .* does not exist"),
        ({"models": [{"name": "a", "checkpoints": ["."]}]}, r"models\[0\].checkpoints: expected a list of two or more"),
        ({"models": [{"name": "a", "checkpoints": [".", "y"]}]}, r"models\[0\].checkpoints\[1\] 'y': .* does not"),
        ({"models": [{"name": "a", "checkpoints": [".", "."], "weights": [1]}]}, r"weights: expected 2 numbers > 0"),
        ({"models": [{"name": "a", "checkpoint": ".", "weights": [1]}]}, r"weights: an ensemble's"),
        ({"models": [{"name": "a", "checkpoint": "."}, {"name": "a", "checkpoint": "."}]}, "two entries have this"),
        ({"models": [{"name": "a", "checkpoint": ".", "pair": ["de-en"]}]}, r"unknown key\(s\) \['pair'\]"),
        ({"models": [{"name": "a", "checkpoint": "."}], "prefer": {"de-en": "b"}}, "prefer.de-en: 'b' is not a model"),
    ],
)
def test_a_models_file_error_names_the_file_and_the_key(tmp_path, content, message):
    from jax_transformer.serving import catalogue

    path = tmp_path / "models.json"
    path.write_text(json.dumps(content), encoding="utf-8")
    with pytest.raises(ConfigError, match=message):
        catalogue.read(path)


def test_serve_takes_an_ensemble_on_its_command_line_and_refuses_banned_phrases_at_start(tmp_path):
    """`serve --checkpoint A --checkpoint B` serves the ensemble of the two runs (as a --models entry with
    "checkpoints" does), and a decoding that bans phrases, whose programs a service does not compile ahead, is
    refused before anything is compiled, naming where it was given."""
    from jax_transformer.cli import flags
    from jax_transformer.cli.main import build_parser
    from jax_transformer.decoding.translator import Translator
    from jax_transformer.serving import service
    from jax_transformer.settings.config import ServeConfig
    from tests.helpers.saved import saved_run

    run = saved_run(tmp_path / "numbers")
    args = build_parser().parse_args(["serve", "--checkpoint", str(run), "--checkpoint", str(run), "--step", "latest"])
    assert args.checkpoint == [str(run), str(run)]
    served = flags.translator(args).served.config
    assert type(served).__name__ == "EnsembleConfig"
    banning = service.Entry("numbers", Translator(run, "latest", suppress="deux"), None, "models[0]")
    with pytest.raises(ConfigError, match=r"models\[0\]: suppress 'deux': a service does not ban phrases yet"):
        service.build([banning], ServeConfig(), detect=False)
