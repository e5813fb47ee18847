"""bfloat16 mixed precision and the attention kernels: the policy itself, checked where it is decided.

- The compiled program: every matmul (dot_general) of the bfloat16 training step and decoders multiplies bfloat16
  operands, so no float32 operand (a float32 constant such as the sinusoid table, a forgotten cast) promotes one.
- The dtype table of docs/gpu-tpu.md, in both frameworks: what each kind of module returns, and in
  the PyTorch twin every matrix multiplication kernel it runs, forward and backward.
- The settings: bad values are named; checkpoints and weight files ignore how to compute, so a bfloat16 run
  resumes and evaluates in float32 and back, and checkpoints hold float32 parameters.
Numbers in both frameworks (logits, loss, gradients, tokens): parity_tests/test_bf16_parity.py and
parity_tests/test_decoding_parity.py; the attention kernels against the explicit path: parity_tests/
test_attention_kernels.py.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from jax_transformer.checkpoint import manager as ckpt_lib
from jax_transformer.decoding import decoders, schedule, search
from jax_transformer.errors import ConfigError
from jax_transformer.model.transformer import Transformer, attention_maps, init_params
from jax_transformer.settings.config import preset
from jax_transformer.training import trainer
from tests.helpers.batches import make_batch
from tests.helpers.configs import PARITY_CONFIGS
from tests.helpers.training import run_main, tiny_train_args, write_corpus
from tests.helpers.twins import flat, t, twin_models

CONFIG = PARITY_CONFIGS["pre_learned_untied_gelu_nobias"]  # every switch the other way from the paper's defaults

# --- the compiled program ---------------------------------------------------------------------------------------

# `stablehlo.dot_general %a, %b, ..., [algorithm = <lhs_precision_type = bf16, ...>] : (tensor<AxBxf32>, ...)`
DOT = re.compile(r"stablehlo\.dot_general (.*?) : \((tensor<[^>]*>), (tensor<[^>]*>)\) -> (tensor<[^>]*>)")


def dot_operand_types(program_text: str) -> list[tuple[str, str, str]]:
    """(lhs, rhs, result) element types of every dot_general in a lowered program. An operand the dot's `algorithm`
    rounds to bfloat16 before multiplying (jax.nn.dot_product_attention's BF16_BF16_F32) counts as bf16."""
    found = []
    for attributes, lhs, rhs, result in DOT.findall(program_text):
        kinds = [ty.rsplit("x", 1)[-1].rstrip(">") for ty in (lhs, rhs, result)]
        if "lhs_precision_type = bf16" in attributes and "rhs_precision_type = bf16" in attributes:
            kinds[:2] = ["bf16", "bf16"]
        found.append(tuple(kinds))
    assert found, "no dot_general found: has the program text format changed?"
    return found


def _shapes(tree):
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), tree)


def _lowered_programs(config) -> dict[str, str]:
    """The training step (dropout on), the decoders' encoder, greedy and beam search of `config`, lowered (traced,
    not compiled)."""
    opt = trainer.OptimConfig()
    batch = _shapes(make_batch(config))
    step = trainer.make_train_step(config, opt).lower(trainer.abstract_train_state(config, opt), batch)
    params = jax.eval_shape(lambda: init_params(config))
    src = jax.ShapeDtypeStruct((2, 6), jnp.int32)
    rows = schedule.row_shapes(2, 8)  # the shapes of each row's limit, prefix and draw id
    scalar = jax.ShapeDtypeStruct((), jnp.int32)
    memory = jax.ShapeDtypeStruct((2, 6, config.d_model), jnp.float32)
    encoder = search.encoder.lower(params, src, config=config, width=6)
    programs = {}
    for name, greedy in (("greedy", True), ("beam", False)):
        rules = decoders.gnmt_decoder(config, 6, beam_size=2, greedy=greedy, max_len_a=0, max_len_b=8).rules
        options = dict(config=config, length=8, cache_len=8)
        programs[name] = search.start.lower(params, src, memory, rules, rows, scalar, **options)
    greedy, beam = programs["greedy"], programs["beam"]
    texts = (step, encoder, greedy, beam)
    return dict(zip(("train step", "encoder", "greedy", "beam"), (program.as_text() for program in texts)))


@pytest.mark.parametrize(
    "dtype,kernel", [("bfloat16", "explicit"), ("bfloat16", "xla"), ("float32", "explicit")], ids=lambda x: x
)
def test_every_matmul_multiplies_operands_of_the_compute_dtype(dtype, kernel):
    config = CONFIG.replace(dtype=dtype, attention_kernel=kernel, dropout=0.1)
    expected = {"bfloat16": "bf16", "float32": "f32"}[dtype]
    for name, text in _lowered_programs(config).items():
        kinds = dot_operand_types(text)
        wrong = [k for k in kinds if k[:2] != (expected, expected)]
        assert not wrong, f"{name}: {len(wrong)} of {len(kinds)} matmuls have operands {sorted(set(wrong))}"
        # Results: the compute dtype, or the float32 accumulator: every projection's (its bias is added to the
        # accumulator and the sum rounded once, model.Dense), the logits' (never rounded) and, with the xla kernel,
        # the attention scores (jax.nn.dot_product_attention keeps them in float32 too).
        assert {k[2] for k in kinds} <= {expected, "f32"}
    # The lowering is not blind to float32: the same program in float32 mode is all f32 (checked by the f32 case).


def test_a_projection_rounds_once_as_torch_linear():
    """model.Dense in bfloat16: the bias is added to the float32 accumulator and the sum rounded once, as torch's
    F.linear does; flax's nn.Dense would round the matmul's result, then the sum (twice the error, and not the
    twin's numbers)."""
    import ml_dtypes
    import torch.nn.functional as F

    from jax_transformer.model.transformer import Dense

    rng = np.random.default_rng(0)
    as_bf16 = lambda x: np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)
    x, w, b = (as_bf16(rng.normal(size=shape)) for shape in ((256, 32), (32, 32), (32,)))
    params = {"kernel": w.astype(np.float32), "bias": b.astype(np.float32)}
    ours = np.asarray(Dense(32, dtype=jnp.bfloat16).apply({"params": params}, x.astype(np.float32)), np.float64)
    theirs = F.linear(*(torch.tensor(a, dtype=torch.bfloat16) for a in (x, w.T, b))).double().numpy()
    exact = x @ w + b  # float64: exact for these operands, up to the sum's rounding
    assert np.array_equal(ours, as_bf16(exact)) and np.array_equal(ours, theirs)
    assert not np.array_equal(ours, as_bf16(as_bf16(x @ w) + b))  # rounding twice gives other numbers here


def test_compiled_bfloat16_programs_round_where_the_model_says():
    """The library's compiled programs in bfloat16 (`compilation.jit`: XLA's excess precision off) compute what
    the model computes op by op, within the bfloat16 tolerance of the parity tests. With XLA's default, the jitted
    forward of the saved model below keeps float32 values where the model rounds to bfloat16, and its logits land
    farther from the op-by-op ones than that tolerance."""
    from jax_transformer import compilation
    from jax_transformer.interop import verify
    from tests.helpers.saved import load_saved_model
    from tests.helpers.tolerances import logit_tolerance

    saved = load_saved_model("bf16_beam_case")
    config = saved.config.replace(dtype="bfloat16")
    src = saved.sources
    tgt_in = np.concatenate([np.full((len(src), 1), config.bos_id), src[:, :-1]], axis=1).astype(np.int32)
    tgt_in[tgt_in == config.eos_id] = config.pad_id
    with jax.disable_jit():
        eager = np.asarray(Transformer(config).apply({"params": saved.params}, src, tgt_in))
    compiled = np.asarray(verify.flax_logits_fn(config)(saved.params, src, tgt_in))
    tolerance = logit_tolerance(config, eager)
    assert np.abs(compiled - eager).max() <= tolerance
    assert compilation.compiler_options("bfloat16") == {"xla_allow_excess_precision": False}
    assert compilation.compiler_options("float32") is None  # float32 programs compile as they always did


# --- the dtype table, both frameworks ---------------------------------------------------------------------------

# docs/gpu-tpu.md's table: what each kind of module returns in bfloat16 mode (float32 mode: float32 everywhere).
TABLE = {
    "embedding + positions (the residual stream)": "float32",
    "attention / feed-forward sub-layer output": "bfloat16",
    "LayerNorm output": "float32",
    "attention probabilities (softmax)": "float32",
    "logits": "float32",
}


def _flax_dtypes(config, batch) -> dict[str, set[str]]:
    model, params = Transformer(config), init_params(config)
    # Every module's output captured; eval_shape gives their dtypes without compiling or computing anything.
    logits, state = jax.eval_shape(
        lambda p, src, tgt_in: model.apply(
            {"params": p}, src, tgt_in, capture_intermediates=True, mutable=["intermediates"]
        ),
        params,
        batch["src"],
        batch["tgt_in"],
    )
    found: dict[str, set[str]] = {kind: set() for kind in TABLE}
    for path, value in jax.tree_util.tree_flatten_with_path(state["intermediates"])[0]:
        keys = "/".join(str(p.key) for p in path if hasattr(p, "key"))
        if keys.endswith("/attention"):  # sown by the explicit path
            found["attention probabilities (softmax)"].add(str(value.dtype))
        elif "norm/__call__" in keys:
            found["LayerNorm output"].add(str(value.dtype))
        elif keys.endswith(("self_attention/__call__", "cross_attention/__call__", "feed_forward/__call__")):
            found["attention / feed-forward sub-layer output"].add(str(value.dtype))
        elif keys.endswith("positions/__call__"):
            found["embedding + positions (the residual stream)"].add(str(value.dtype))
    found["logits"].add(str(logits.dtype))
    return found


def _torch_dtypes(config, batch) -> dict[str, set[str]]:
    import torch_reference
    from torch_reference.model import FeedForward, MultiHeadAttention, Positions

    _, params, model = twin_models(config)
    found: dict[str, set[str]] = {kind: set() for kind in TABLE}
    kinds = {
        torch.nn.LayerNorm: "LayerNorm output",
        MultiHeadAttention: "attention / feed-forward sub-layer output",
        FeedForward: "attention / feed-forward sub-layer output",
        Positions: "embedding + positions (the residual stream)",
    }
    for module in model.modules():
        for cls, kind in kinds.items():
            if isinstance(module, cls):
                module.register_forward_hook(lambda m, i, out, kind=kind: found[kind].add(str(out.dtype)[6:]))
    with torch.no_grad(), model.record_attention() as maps:
        logits = model(t(batch["src"]), t(batch["tgt_in"]))
    found["logits"].add(str(logits.dtype)[6:])
    found["attention probabilities (softmax)"] |= {str(p.dtype)[6:] for p in maps.values()}
    assert isinstance(model, torch_reference.Transformer)
    return found


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_both_frameworks_follow_the_dtype_table(dtype):
    config = CONFIG.replace(dtype=dtype)
    batch = make_batch(config)
    expected = {kind: {value if dtype == "bfloat16" else "float32"} for kind, value in TABLE.items()}
    assert _flax_dtypes(config, batch) == expected
    assert _torch_dtypes(config, batch) == expected


class MatmulRecorder(TorchDispatchMode):
    """Records the operands of every matrix-multiplication kernel torch runs (forward and backward alike)."""

    OPS = ("mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "dot", "linear")

    def __init__(self):
        super().__init__()
        self.operands: list[tuple[str, list[torch.Tensor]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name in self.OPS:
            self.operands.append((name, [a for a in args if isinstance(a, torch.Tensor) and a.dim() >= 2]))
        return func(*args, **(kwargs or {}))


def test_every_twin_matmul_multiplies_bfloat16_values():
    """The twin in bfloat16, forward and backward: every matmul kernel gets bfloat16 operands, except the logits'
    forward (MatmulFloat32Result), which multiplies float32 copies of bfloat16 values; so each operand must equal
    its own rounding to bfloat16."""
    from torch_reference import losses as torch_losses

    config = CONFIG.replace(dtype="bfloat16")
    batch = make_batch(config)
    _, _, model = twin_models(config)
    recorder = MatmulRecorder()
    with recorder:
        logits = model(t(batch["src"]), t(batch["tgt_in"]))
        torch_losses.mean_loss(logits, t(batch["tgt_out"]), config.pad_id, 0.1).backward()
    assert len(recorder.operands) > 20
    float32_ones = 0
    for name, operands in recorder.operands:
        for x in operands:
            float32_ones += x.dtype == torch.float32
            assert x.dtype in (torch.bfloat16, torch.float32), (name, x.dtype)
            assert torch.equal(x.float(), x.bfloat16().float()), f"{name}: an operand that is not bfloat16 values"
    assert float32_ones == 2  # the forward logits matmul's two operands, nothing else


# --- settings, checkpoints, weight files ---------------------------------------------------------------------


def test_bad_compute_settings_are_named():
    with pytest.raises(ConfigError, match=r"'dtype' must be one of \('float32', 'bfloat16'\), got 'float16'"):
        CONFIG.replace(dtype="float16")
    with pytest.raises(ConfigError, match="'attention_kernel' must be one of"):
        CONFIG.replace(attention_kernel="flash")
    with pytest.raises(ConfigError, match="'cudnn' needs dtype 'bfloat16'"):
        CONFIG.replace(attention_kernel="cudnn")
    with pytest.raises(ConfigError, match="head_dim .* multiple of 8, got dtype 'bfloat16' and head_dim 12"):
        preset("tiny", d_model=48, num_heads=4, dtype="bfloat16", attention_kernel="cudnn")
    if jax.default_backend() != "gpu":  # refused by name when the model runs, not deep inside jax
        config = CONFIG.replace(dtype="bfloat16", attention_kernel="cudnn")
        batch = make_batch(config)
        with pytest.raises(ConfigError, match="attention_kernel 'cudnn' needs a CUDA GPU; this process runs on"):
            jax.eval_shape(
                lambda p: Transformer(config).apply({"params": p}, batch["src"], batch["tgt_in"]), init_params(config)
            )
    for argv in (["train", "--dtype", "float16"], ["translate", "--checkpoint", "x", "--attention-kernel", "flash"]):
        code, out, err = run_main(argv)
        assert code == 2 and "invalid choice" in err  # argparse's, the choices listed


def test_checkpoint_config_check_ignores_how_to_compute():
    ckpt_lib.check_config(CONFIG, CONFIG.replace(dtype="bfloat16", attention_kernel="xla"))
    with pytest.raises(ConfigError) as error:
        ckpt_lib.check_config(CONFIG, CONFIG.replace(dtype="bfloat16", d_model=128))
    assert "'d_model'" in str(error.value) and "dtype" not in str(error.value)


def test_attention_maps_need_the_explicit_path_and_get_it():
    """With a fused kernel chosen, asking for attention probabilities still gets them (the explicit path runs)."""
    config = CONFIG.replace(attention_kernel="xla")
    batch = make_batch(config)
    _, state = Transformer(config).apply(
        {"params": init_params(config)}, batch["src"], batch["tgt_in"], mutable=["intermediates"]
    )
    maps = attention_maps(state["intermediates"])
    assert len(maps) == config.num_encoder_layers + 2 * config.num_decoder_layers
    np.testing.assert_allclose(np.asarray(maps["decoder/layer_0/cross_attention"]).sum(-1), 1.0, atol=1e-5)


@pytest.mark.slow
def test_bfloat16_run_resumes_and_evaluates_in_float32(tmp_path):
    """train.py --dtype bfloat16: its checkpoints hold float32 parameters and say bfloat16; it resumes in float32
    (the new checkpoints say float32) and back; translate and export choose the dtype too."""
    from jax_transformer.interop.export import import_weights

    train = write_corpus(tmp_path)
    run = tmp_path / "run"
    code, out, err = run_main(tiny_train_args(run, train, steps=2, extra=("--dtype", "bfloat16")))
    assert code == 0, out + err
    first = ckpt_lib.load(run, "latest")
    assert first.config.dtype == "bfloat16"
    assert {str(v.dtype) for v in flat(first.state).values()} == {"float32", "int32", "uint32"}  # + step, key
    assert {str(v.dtype) for v in flat(first.params).values()} == {"float32"}

    code, out, err = run_main(["train", "--resume", str(run), "--steps", "3", "--dtype", "float32", "--no-progress"])
    assert code == 0, out + err
    resumed = ckpt_lib.load(run, "latest")
    assert resumed.step == 3 and resumed.config == first.config.replace(dtype="float32")
    code, out, err = run_main(["train", "--resume", str(run), "--steps", "4", "--dtype", "bfloat16", "--no-progress"])
    assert code == 0, out + err
    assert ckpt_lib.load(run, "latest").config.dtype == "bfloat16"

    text = tmp_path / "in.txt"
    text.write_text("twelve\nthree hundred and one\n", encoding="utf-8")
    outputs = {}
    for dtype in ("float32", "bfloat16"):
        argv = ["translate", "--checkpoint", str(run), "--step", "latest", "--input", str(text), "--dtype", dtype]
        code, outputs[dtype], err = run_main([*argv, "--beam-size", "1"])
        assert code == 0 and f"({dtype})" in err, err
        assert len(outputs[dtype].splitlines()) == 2

    exported = tmp_path / "m.pt"
    code, out, err = run_main(["export", "--checkpoint", str(run), "--step", "latest", "--output", str(exported)])
    assert code == 0, out + err
    params, config, _ = import_weights(exported, first.config.replace(dtype="float32"))
    assert config.dtype == "float32" and config.replace(dtype="bfloat16") == first.config.replace(dtype="bfloat16")
    assert {str(v.dtype) for v in flat(params).values()} == {"float32"}
