"""Weight files (`jax_transformer.interop.export`): torch.save and safetensors exports round-trip bit-exactly, a
safetensors export loads into torch_reference without pickle and gives the Flax logits, the format is read off
the content, and broken files fail with errors naming the file."""

import base64

import jax
import numpy as np
import pytest
import safetensors.numpy
import safetensors.torch
import torch
from safetensors import safe_open

import torch_reference
from jax_transformer.data.tokenizer import Tokenizer
from jax_transformer.errors import CheckpointError, ConfigError, PortError
from jax_transformer.interop.export import export_weights, import_weights
from jax_transformer.interop.port import flax_to_torch, torch_to_flax
from jax_transformer.model.transformer import Transformer, init_params
from jax_transformer.settings.config import TransformerConfig
from tests.helpers.batches import make_batch
from tests.helpers.configs import PARITY_CONFIGS as CONFIGS
from tests.helpers.twins import max_abs_diff, t, twin_device

ATOL = 1e-5  # forward quantities: see test_forward_parity.py
SUFFIX = {"torch": ".pt", "safetensors": ".safetensors"}


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.train([f"w{i} v{i % 7} u{i % 3}" for i in range(300)], 40, model_type="bpe")


def _leaves(params):
    return {jax.tree_util.keystr(path): np.asarray(v) for path, v in jax.tree_util.tree_flatten_with_path(params)[0]}


def _assert_same_params(a, b):
    a, b = _leaves(a), _leaves(b)
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype == np.float32, key
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
def test_round_trip_is_bit_exact(config_case, fmt, tokenizer, tmp_path):
    _, cfg = config_case
    params = init_params(cfg, seed=3)
    path = export_weights(tmp_path / f"model{SUFFIX[fmt]}", params, cfg, tokenizer)  # format from the suffix
    assert path.read_bytes()[:2] == b"PK" if fmt == "torch" else path.read_bytes()[:2] != b"PK"
    back, config, file_tokenizer = import_weights(path)
    assert config == cfg and file_tokenizer.to_bytes() == tokenizer.to_bytes()
    _assert_same_params(params, back)


def test_safetensors_export_loads_in_torch_reference_without_pickle(tokenizer, tmp_path, parity_report):
    cfg = CONFIGS["pre_learned_untied_gelu_nobias"]
    params = init_params(cfg, seed=4)
    path = export_weights(tmp_path / "model.safetensors", params, cfg, tokenizer)
    with safe_open(path, framework="np") as f:
        metadata = f.metadata()
    assert metadata["format"] == "jax_transformer.safetensors_export.v1"
    assert TransformerConfig.from_json(metadata["config"]) == cfg
    assert base64.b64decode(metadata["tokenizer"]) == tokenizer.to_bytes()
    # numpy reads it too, with the torch_reference names and float32 values
    arrays = safetensors.numpy.load_file(path)
    expected = flax_to_torch(params)
    assert arrays.keys() == expected.keys()
    assert all(arrays[k].dtype == np.float32 and np.array_equal(arrays[k], expected[k]) for k in expected)
    # PyTorch, without torch.load: strict load, then the same logits as the Flax model
    model = torch_reference.Transformer(TransformerConfig.from_json(metadata["config"])).eval()
    model.load_state_dict(safetensors.torch.load_file(path), strict=True)
    model.to(twin_device())  # where t() puts the batch (`pytest --device cuda`: the GPU)
    batch = make_batch(cfg, seed=4)
    src, tgt_in = batch["src"], batch["tgt_in"]
    with torch.no_grad():
        reference = model(t(src), t(tgt_in))
    diff = max_abs_diff(Transformer(cfg).apply({"params": params}, src, tgt_in), reference)
    parity_report("logits, safetensors export in torch", "pre_learned_untied_gelu_nobias", diff, ATOL)
    assert diff <= ATOL


def test_format_is_read_off_the_content_and_bare_state_dicts_need_a_config(tmp_path):
    cfg = CONFIGS["post_sinusoidal_tied_relu"]
    params = init_params(cfg, seed=5)
    # misleading suffixes: the content decides
    for fmt, name in (("torch", "a.safetensors"), ("safetensors", "b.pt")):
        back, config, tokenizer = import_weights(export_weights(tmp_path / name, params, cfg, format=fmt))
        assert config == cfg and tokenizer is None
        _assert_same_params(params, back)
    with pytest.raises(ValueError, match="export format must be one of"):
        export_weights(tmp_path / "c.pt", params, cfg, format="onnx")
    # bare torch_reference state_dicts, either format: the given config is used, and none is an error
    state = torch_reference.Transformer(cfg).state_dict()
    torch.save(state, tmp_path / "bare.pt")
    torch.save(state, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)  # pickle, not a zip
    safetensors.torch.save_file(state, tmp_path / "bare.safetensors")
    for name in ("bare.pt", "legacy.pt", "bare.safetensors"):
        back, config, tokenizer = import_weights(tmp_path / name, cfg)
        assert config == cfg and tokenizer is None
        _assert_same_params(torch_to_flax(state, cfg), back)
        with pytest.raises(CheckpointError, match=f"{name}: a bare state_dict has no config"):
            import_weights(tmp_path / name)
    # a config that contradicts the file's: the field is named
    with pytest.raises(ConfigError, match=r"'d_ff': weight file .*b\.pt has 128, requested 64"):
        import_weights(tmp_path / "b.pt", cfg.replace(d_ff=64))


def test_broken_files_give_errors_naming_the_file(tmp_path):
    cfg = CONFIGS["post_sinusoidal_tied_relu"]
    params = init_params(cfg, seed=6)
    good = {fmt: export_weights(tmp_path / f"good{SUFFIX[fmt]}", params, cfg).read_bytes() for fmt in SUFFIX}

    def write(name, data):
        (tmp_path / name).write_bytes(data)
        return tmp_path / name

    header_end = 8 + int.from_bytes(good["safetensors"][:8], "little")
    cases = {  # file -> what the error says
        write("cut_data.safetensors", good["safetensors"][:-100]): "cannot read as a safetensors file",
        write("cut_header.safetensors", good["safetensors"][: header_end - 10]): "truncated safetensors file",
        write(
            "bad_json.safetensors", good["safetensors"][:9] + b"!" + good["safetensors"][10:]
        ): "corrupt safetensors header",
        write("cut.pt", good["torch"][: len(good["torch"]) // 2]): "cannot read as a PyTorch (torch.save) file",
        write("noise.bin", bytes(range(256)) * 4): "neither a safetensors file nor",
    }
    for path, message in cases.items():
        with pytest.raises(CheckpointError) as info:
            import_weights(path, cfg)
        assert str(path) in str(info.value) and message in str(info.value), str(info.value)
    with pytest.raises(CheckpointError, match="weight file not found"):
        import_weights(tmp_path / "absent.safetensors", cfg)

    # non-float32 tensors: refused by name unless converting is asked for
    state = torch_reference.Transformer(cfg).state_dict()
    half = write("half.safetensors", b"")
    safetensors.torch.save_file({k: v.to(torch.bfloat16) for k, v in state.items()}, half)
    with pytest.raises(PortError, match=r"half\.safetensors: tensors that are not float32: .*\(BF16\)"):
        import_weights(half, cfg)
    converted, _, _ = import_weights(half, cfg, convert_dtypes=True)
    _assert_same_params(
        torch_to_flax({k: v.to(torch.bfloat16) for k, v in state.items()}, cfg, convert_dtypes=True), converted
    )

    # wrong and missing names: the port's list, with the file named
    wrong = {k.replace("encoder.layers.1.", "encoder.layers.7."): v for k, v in state.items()}
    for name, save in (("wrong.safetensors", safetensors.torch.save_file), ("wrong.pt", torch.save)):
        save(wrong, tmp_path / name)
        with pytest.raises(PortError) as info:
            import_weights(tmp_path / name, cfg)
        message = str(info.value)
        assert message.startswith(str(tmp_path / name))
        assert "missing encoder.layers.1.feed_forward.linear1.weight" in message
        assert "unexpected encoder.layers.7.feed_forward.linear1.weight" in message
