#!/usr/bin/env python3
"""The cross-framework promise at training scale: the PyTorch twin and the Flax model trained side by side.

    python benchmarks/twin_curve.py                  # 300 steps; Multi30k batches if the data are there
    python benchmarks/twin_curve.py --steps 20 --data none --checks --output /tmp/curve.png   # a quick look

Both start from the same weights (Flax's initialisation, ported to torch_reference), see the same batches in the
same order (real Multi30k de->en pairs from `--data`, default /work/shared/data/multi30k, or the built-in numbers
task when that folder is missing), with every dropout off, and take the paper's Adam steps
(`jax_transformer.training.trainer` against `torch_reference.training`, the same `OptimConfig`; the peak learning rate
of the multi30k recipe, docs/quality.md). The parity tests check three such steps; here they run for hundreds. The
script draws both loss curves and their relative gap |loss_a - loss_b| / loss_b per step
(`docs/twin_training_curve.png`), and prints the largest gap and how far apart the parameters end (per tensor:
||p_a - p_b|| / ||p_a - p_initial||, the movement-relative measure of parity_tests/test_training_parity.py).

How large a gap should be: training amplifies any difference. Adam divides each gradient by its own root mean
square, so an element whose gradient is mostly rounding noise steps by ~lr in a direction the noise decides, and
ReLUs switch where a pre-activation crosses zero; float32 summation order alone (~1e-7 at step 1) therefore grows
over hundreds of steps. Two baselines, drawn beside the float32 gap (`--checks`), measure that growth:
- self: Flax against Flax whose initial weights are moved by one float32 ulp. Same code, same arithmetic: its gap
  is how far any two float32 runs a rounding apart drift. A Flax-PyTorch gap of that size is all rounding.
- twin64: Flax against PyTorch, both in float64 (jax_enable_x64, torch .double()). A real difference between the
  frameworks (a wrong constant, a different rule) would show here at its own size from the step it acts; exact
  arithmetic leaves only the one float32 quantity in both steps (JAX's schedule computes the learning rate in
  float32, LambdaLR in float64: ~1e-9 relative) to be amplified, from a much smaller start.

A correctness figure, not a speed figure: nothing here is timed. Full-precision matmuls in both.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `python benchmarks/twin_curve.py` puts benchmarks/ first on the path
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

DEFAULT_DATA = Path("/work/shared/data/multi30k")
# The peak learning rate of the multi30k recipe (d_model 256, warmup 300, lr scale 0.5: 1.8e-3), reached here
# by the d_model 64 model at step 100: 0.144 * 64**-0.5 * 100**-0.5 = 1.8e-3.
LR_SCALE = 0.144


def load_pairs(data: str):
    """(corpus, description): Multi30k's train.de/train.en from `data` if they exist, else the built-in task."""
    from jax_transformer.data.corpus import read_parallel
    from jax_transformer.data.default_task import default_pairs

    folder = Path(data) if data != "none" else None
    if folder is not None and (folder / "train.de").is_file() and (folder / "train.en").is_file():
        return read_parallel(folder / "train.de", folder / "train.en"), f"Multi30k de->en training pairs ({folder})"
    return default_pairs("train", 5000), "the built-in numbers task (English -> French), 5,000 pairs"


# The comparisons the script can draw: (name, left side, right side, dtype).
COMPARISONS = {
    "twin": ("Flax vs PyTorch, float32", "jax", "torch", np.float32),
    "twin64": ("Flax vs PyTorch, both in float64", "jax", "torch", np.float64),
    "self": ("Flax vs Flax started 1 float32 ulp apart", "jax", "jax-nudged", np.float32),
}


class _JaxSide:
    """jax_transformer's train step on its own state. `nudge`: every initial weight moved by one ulp (to +inf)."""

    def __init__(self, config, optim, params, nudge: bool = False):
        import jax

        from jax_transformer.training import trainer

        if nudge:
            params = jax.tree_util.tree_map(lambda p: np.nextafter(p, np.array(np.inf, p.dtype)), params)
        self.state = trainer.create_train_state(config, optim, params=params)
        self.step_fn = trainer.make_train_step(config, optim, dropout=False)

    def step(self, batch) -> float:
        self.state, sums = self.step_fn(self.state, batch)
        return float(sums["loss"]) / float(sums["tokens"])

    def weights(self) -> dict[str, np.ndarray]:
        import jax

        from jax_transformer.interop.port import flax_to_torch

        return flax_to_torch(jax.device_get(self.state.params))


class _TorchSide:
    """torch_reference's train step (torch.optim.Adam + LambdaLR), in the dtype of the given weights."""

    def __init__(self, config, optim, weights: dict[str, np.ndarray]):
        import torch

        import torch_reference
        from torch_reference import training as torch_training

        dtype = torch.float64 if next(iter(weights.values())).dtype == np.float64 else torch.float32
        model = torch_reference.Transformer(config).to(dtype)
        self.model = torch_reference.load_numpy_state_dict(model, weights).train()
        self.optimizer, self.scheduler = torch_training.make_optimizer(self.model, optim)
        self.optim, self.train_step = optim, torch_training.train_step

    def step(self, batch) -> float:
        sums = self.train_step(self.model, self.optimizer, self.scheduler, batch, self.optim)
        return sums["loss"] / sums["tokens"]

    def weights(self) -> dict[str, np.ndarray]:
        import torch_reference

        return torch_reference.numpy_state_dict(self.model)


def setup(data: str, rows: int, width: int):
    """(corpus encoded, config, optim, description): the data, the small dropout-free model and the optimiser."""
    from jax_transformer.data.batching import encode_corpus
    from jax_transformer.data.tokenizer import Tokenizer
    from jax_transformer.settings.config import OptimConfig, preset

    corpus, described = load_pairs(data)
    tokenizer = Tokenizer.train(corpus.sources + corpus.targets, 2000, model_type="bpe")
    no_dropout = dict(dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, embedding_dropout=0.0)
    config = preset(
        "small",
        src_vocab_size=tokenizer.vocab_size,
        tgt_vocab_size=tokenizer.vocab_size,
        share_embeddings=True,
        d_model=64,
        num_heads=4,
        d_ff=256,
        num_encoder_layers=2,
        num_decoder_layers=2,
        max_len=width,
        **no_dropout,
    )
    optim = OptimConfig(warmup_steps=100, lr_scale=LR_SCALE)
    encoded = encode_corpus(corpus, tokenizer, config.max_len, on_too_long="skip")
    described = (
        f"{described}; {len(encoded)} pairs fit {width} tokens; batches of {rows} x {width}; vocabulary "
        f"{tokenizer.vocab_size}; d_model {config.d_model}, {config.num_encoder_layers}+{config.num_decoder_layers} "
        f"layers, dropout off; Adam, warmup {optim.warmup_steps}, peak learning rate 1.8e-3, label smoothing "
        f"{optim.label_smoothing}"
    )
    return encoded, config, optim, described


def run(comparison: str, steps: int, data: str, rows: int, width: int, seed: int, print_fn=print) -> dict:
    """Trains the two sides of `comparison` (a COMPARISONS key) `steps` steps from the same initial weights on the
    same batches; returns both loss curves and the figures (see the module docstring). A float64 comparison
    switches jax_enable_x64 on for the rest of the process: run it last."""
    import jax
    import torch

    from tests.helpers.batches import corpus_batches
    from tests.helpers.twins import ported_params

    title, left, right, dtype = COMPARISONS[comparison]
    jax.config.update("jax_default_matmul_precision", "highest")
    torch.use_deterministic_algorithms(True)
    # One thread: on a shared 2-core machine torch's second thread waits for a busy core, and a step of this small
    # model took 0.4-5 s instead of 0.08 s (measured under load). Speed is no figure here.
    torch.set_num_threads(1)
    if dtype == np.float64:
        jax.config.update("jax_enable_x64", True)

    encoded, config, optim, described = setup(data, rows, width)
    print_fn(f"{title}: {described}")
    params, torch_state = ported_params(config, seed)
    params = jax.tree_util.tree_map(lambda p: np.asarray(p, dtype), params)
    initial = {k: np.array(v, dtype) for k, v in torch_state.items()}
    make = {
        "jax": lambda: _JaxSide(config, optim, params),
        "jax-nudged": lambda: _JaxSide(config, optim, params, nudge=True),
        "torch": lambda: _TorchSide(config, optim, initial),
    }
    sides = (make[left](), make[right]())

    batches = corpus_batches(encoded, config, rows, width, seed=seed)
    losses = ([], [])
    began = time.time()
    for step in range(1, steps + 1):
        batch = next(batches)
        for side, curve in zip(sides, losses):
            curve.append(side.step(batch))
        if step % 50 == 0 or step == steps:
            print_fn(f"  step {step}: loss {losses[0][-1]:.5f} vs {losses[1][-1]:.5f} ({time.time() - began:.0f} s)")
    a, b = np.array(losses[0]), np.array(losses[1])
    gaps = np.abs(a - b) / np.abs(b)
    final_a, final_b = sides[0].weights(), sides[1].weights()
    # The key-projection biases are left out: their gradient is zero analytically (see test_training_parity.py),
    # so both sides move them by rounding noise alone and the movement-relative measure is meaningless there.
    relative = {
        k: float(np.linalg.norm(final_a[k] - final_b[k]) / np.linalg.norm(final_a[k] - initial[k]))
        for k in initial
        if not k.endswith("key.bias")
    }
    worst_tensor = max(relative, key=relative.get)
    return {
        "comparison": comparison,
        "title": title,
        "data": described,
        "steps": steps,
        "batch": [rows, width],
        "config": config.to_dict(),
        "optim": optim.to_dict(),
        "loss_a": losses[0],
        "loss_b": losses[1],
        "relative_gap": gaps.tolist(),
        "largest_relative_gap": float(gaps.max()),
        "largest_gap_step": int(gaps.argmax()) + 1,
        "worst_tensor": worst_tensor,
        "worst_tensor_relative_difference": relative[worst_tensor],
    }


def plot(results: list[dict], path: Path) -> Path:
    """The first comparison's two loss curves (left) and every comparison's relative gap per step (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    main = results[0]
    steps = np.arange(1, main["steps"] + 1)
    fig, (ax_loss, ax_gap) = plt.subplots(1, 2, figsize=(13, 5))
    ax_loss.plot(steps, main["loss_a"], label="Flax (jax_transformer)", linewidth=2.5, alpha=0.6)
    ax_loss.plot(steps, main["loss_b"], "--", label="PyTorch (torch_reference)", linewidth=1.0, color="k")
    ax_loss.set(xlabel="step", ylabel="label-smoothed loss per target token", title=main["title"])
    ax_loss.legend()
    floor = 1e-17  # log scale: an exact 0 is drawn at the floor
    for result, color in zip(results, ("tab:red", "tab:blue", "tab:gray")):
        gap = np.maximum(np.array(result["relative_gap"]), floor)
        label = f"{result['title']} (largest {result['largest_relative_gap']:.1e})"
        ax_gap.semilogy(np.arange(1, result["steps"] + 1), gap, color=color, linewidth=0.8, label=label)
    ax_gap.set(xlabel="step", ylabel="|loss A - loss B| / loss B", title="Relative gap between the two loss curves")
    ax_gap.grid(alpha=0.3, which="both")
    ax_gap.legend(fontsize=8, loc="lower right")
    fig.suptitle(f"Same initial weights, same batches, dropout off. {main['data']}", fontsize=8, wrap=True)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="training steps of each side (default 300)")
    parser.add_argument(
        "--data",
        default=str(DEFAULT_DATA),
        help=f"folder with train.de / train.en (default {DEFAULT_DATA}); 'none' or a missing folder: the built-in "
        "numbers task",
    )
    parser.add_argument("--rows", type=int, default=32, help="sentence pairs per batch (default 32)")
    parser.add_argument("--width", type=int, default=48, help="tokens per row, source and target (default 48)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the initial weights and the batch order")
    parser.add_argument("--output", default=str(REPO / "docs" / "twin_training_curve.png"), help="the PNG to write")
    parser.add_argument("--json", help="also write the losses and figures as JSON to this file")
    parser.add_argument(
        "--checks",
        nargs="*",
        default=["self", "twin64"],
        choices=["self", "twin64"],
        help="the baselines drawn beside Flax vs PyTorch in float32 (default both; see the module docstring): "
        "self (Flax against Flax started one ulp away) and twin64 (Flax vs PyTorch in float64, the slowest)",
    )
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    order = ["twin"] + [c for c in ("self", "twin64") if c in args.checks]  # float64 last: it switches x64 on
    results = [run(c, args.steps, args.data, args.rows, args.width, args.seed) for c in order]
    path = plot(results, Path(args.output))
    for result in results:
        print(
            f"{result['title']}: largest relative gap of the loss curves {result['largest_relative_gap']:.3e} at "
            f"step {result['largest_gap_step']} of {result['steps']}; parameters at the end: worst tensor "
            f"{result['worst_tensor']} differs by {result['worst_tensor_relative_difference']:.3e} of its movement"
        )
    print(f"wrote {path}")
    if args.json:
        Path(args.json).write_text(json.dumps({r["comparison"]: r for r in results}) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
