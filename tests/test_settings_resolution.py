"""Settings resolve in one module (`jax_transformer.settings.resolve`): no other module of the package merges
settings from two sources, and each rule between settings is written once and holds wherever it is checked."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from jax_transformer.errors import ConfigError
from jax_transformer.settings import resolve
from jax_transformer.settings.config import DecodeConfig, TransformerConfig, beam_limit, check_decoding, preset

PACKAGE = Path(__file__).resolve().parent.parent / "jax_transformer"
# A `.replace(**...)` outside settings/ that merges nothing: init_params computes its dummy pass in the default
# dtype, whatever the model's (not a choice of the user's).
NOT_MERGES = {("model/transformer.py", "init_params")}


def _merges(path: Path, root: Path = PACKAGE) -> list[str]:
    """Places in `path` that build a settings object from two sources: `X.from_dict({**a, ...})` (a dict display
    with an unpacking in it) or `x.replace(**y)` (the fields of one over another), each with its function."""
    found = []
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for function in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
        for node in ast.walk(function):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
                continue
            name = node.func.attr
            merged_dict = name == "from_dict" and any(
                isinstance(arg, ast.Dict) and None in arg.keys for arg in node.args
            )
            unpacked = name == "replace" and any(k.arg is None for k in node.keywords)
            if merged_dict or unpacked:
                where = (str(path.relative_to(root)), function.name)
                if where not in NOT_MERGES:
                    found.append(f"{where[0]}:{node.lineno} in {function.name}: {ast.unparse(node)[:80]}")
    return found


def test_no_module_outside_settings_merges_settings():
    merges = [m for p in sorted(PACKAGE.rglob("*.py")) if "settings" not in p.parts for m in _merges(p)]
    assert not merges, "settings merged outside jax_transformer/settings/resolve.py:\n" + "\n".join(merges)


def test_the_merge_check_can_fail(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f(stored, given):\n    return DecodeConfig.from_dict({**stored, **given})\n")
    assert len(_merges(bad, tmp_path)) == 1


def test_the_resolution_module_has_the_merges():
    """What the test above forbids elsewhere does happen, here: the check looks at the right things."""
    assert _merges(PACKAGE / "settings" / "resolve.py")


# --- the rules, each written once --------------------------------------------------------------------------


@pytest.mark.parametrize("vocab", [5, 8, 9, 40])
def test_a_beam_against_the_vocabulary_is_one_rule_in_both_checks(vocab):
    """config.check_decoding (flags, requests) and the decoders' own argument check (Python callers) accept the
    same widest beam, and refuse one more."""
    from jax_transformer.decoding.decoders import _check_options

    config = preset("tiny", src_vocab_size=vocab, tgt_vocab_size=vocab)
    widest = beam_limit(vocab)
    assert 2 * widest + 3 <= vocab < 2 * (widest + 1) + 3
    if widest >= 1:
        check_decoding(config, DecodeConfig(), {"--beam-size": [widest]})
        _check_options(config, 1.5, 10, 0, beam_size=widest)
    with pytest.raises(ConfigError, match=f"--beam-size {widest + 1}"):
        check_decoding(config, DecodeConfig(), {"--beam-size": [widest + 1]})
    with pytest.raises(ValueError, match=f"beam_size={widest + 1}"):
        _check_options(config, 1.5, 10, 0, beam_size=widest + 1)


def test_the_length_defaults_are_the_settings_defaults():
    from jax_transformer.decoding import attention, decoders

    assert (decoders.DEFAULT_MAX_LEN_A, decoders.DEFAULT_MAX_LEN_B) == (1.5, 10.0)
    assert (decoders.DEFAULT_MAX_LEN_A, decoders.DEFAULT_MAX_LEN_B) == (
        DecodeConfig().max_len_a,
        DecodeConfig().max_len_b,
    )
    import inspect

    defaults = inspect.signature(attention.sentence_attention).parameters
    assert (defaults["max_len_a"].default, defaults["max_len_b"].default) == (1.5, 10.0)


CONFIG = TransformerConfig(src_vocab_size=64, tgt_vocab_size=64)


def test_sampling_against_beams_is_one_rule_for_flags_and_requests():
    """A beam given with sampling is refused, by the flags' resolution and a request's alike (each naming its
    own spelling); a stored beam stays, unused: sampling keeps one hypothesis per sample."""
    with pytest.raises(ConfigError, match=r"--beam-size does not apply to sampling \(--do-sample"):
        resolve.decoding(CONFIG, {}, {"do_sample": True, "beam_size": 3})
    with pytest.raises(ConfigError, match=r"options\.beam_size does not apply to sampling \(options\.do_sample"):
        resolve.request_decoding(CONFIG, DecodeConfig(beam_size=5), {"do_sample": True, "beam_size": 3})
    from_flags = resolve.decoding(CONFIG, {"beam_size": 5}, {"do_sample": True})
    from_request = resolve.request_decoding(CONFIG, DecodeConfig(beam_size=5), {"do_sample": True})
    assert from_flags == from_request and from_flags.beams == 1 and from_flags.beam_size == 5


def test_flags_over_stored_over_defaults():
    stored = {"beam_size": 5, "alpha": 1.0}
    decode = resolve.decoding(CONFIG, stored, {"alpha": 0.2, "n_best": 2})
    assert (decode.beam_size, decode.alpha, decode.n_best, decode.max_len_a) == (5, 0.2, 2, 1.5)
    assert resolve.decoding(CONFIG) == DecodeConfig()


def test_a_sweep_has_greedy_once():
    found = resolve.decodings(CONFIG, {}, {"beam_size": [1, 4], "alpha": [0.6, 1.0]})
    assert [(d.beam_size, d.alpha) for d in found] == [(1, 0.6), (4, 0.6), (4, 1.0)]


def test_computing_settings_change_no_model():
    config = preset("tiny", src_vocab_size=64, tgt_vocab_size=64)
    assert resolve.computed(config, {"dtype": "bfloat16"}).dtype == "bfloat16"
    assert resolve.computed(config, None) is config
    with pytest.raises(ConfigError, match="d_model: not how to compute"):
        resolve.computed(config, {"d_model": 64})


def test_the_evaluations_decode_their_best_hypothesis():
    decode = DecodeConfig(beam_size=6, n_best=3)
    assert resolve.evaluation_decoding(decode) == decode.replace(n_best=1)
    assert resolve.evaluation_decoding(decode, 2) == decode.replace(n_best=1, beam_size=2)


def test_a_language_code_forces_transformers_rules_only_when_nothing_was_chosen():
    assert resolve.forced_language(None, None) == DecodeConfig()
    assert resolve.forced_language(None, 7) == DecodeConfig(rules="transformers", forced_bos=7)
    assert resolve.forced_language(DecodeConfig(beam_size=2), 7) == DecodeConfig(beam_size=2, forced_bos=7)
