"""Settings for the whole test suite that must be in place before jax or torch start, and `pytest --device`.

    python -m pytest -q                           # CPU (CI): the PyTorch twin on the CPU, JAX on its default device
    python -m pytest -q --device cuda             # a GPU machine: the twin on the GPU too (or TWIN_DEVICE=cuda)

On a machine without a GPU every setting below is a no-op (they are read by GPU code paths only), so the suite
is unchanged there. On a GPU machine:
- `--xla_gpu_deterministic_ops=true`: XLA's GPU reductions and scatters (the embedding gradient) are otherwise
  not deterministic, and docs/gpu-tpu.md promises a bitwise-exact resume (tests/test_checkpoint.py).
- `XLA_PYTHON_CLIENT_PREALLOCATE=false`: JAX would take 75% of the GPU's memory at start and starve the PyTorch
  twin in the same process (and train.py in the tests' child processes).
- `CUBLAS_WORKSPACE_CONFIG=:4096:8`: cuBLAS is deterministic only with it, and `torch.use_deterministic_algorithms`
  (parity_tests/conftest.py) refuses to run cuBLAS matmuls without it.
Each is set only where the environment does not set it already. Everywhere, `HF_HUB_OFFLINE=1`: the tests of
pretrained models build theirs from configs, and nothing in the suite may reach the network.
"""

from __future__ import annotations

import os

import pytest

DETERMINISTIC_GPU_FLAG = "--xla_gpu_deterministic_ops=true"
# Unless XLA_FLAGS already names a deterministic-ops flag (benchmarks/gpu.sh falls back to its successor,
# --xla_gpu_exclude_nondeterministic_ops, where an XLA has dropped this one: an unknown flag aborts XLA).
if "deterministic_ops" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {DETERMINISTIC_GPU_FLAG}".strip()
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

DEVICES = ("cpu", "cuda")


def pytest_addoption(parser):
    parser.addoption(
        "--device",
        choices=DEVICES,
        default=None,
        help="where the PyTorch twin runs in the parity tests (default: $TWIN_DEVICE, else cpu); JAX always uses "
        "its default device, the GPU where there is one",
    )


def pytest_configure(config):
    device = config.getoption("--device") or os.environ.get("TWIN_DEVICE", "cpu")
    if device not in DEVICES:
        raise pytest.UsageError(f"TWIN_DEVICE={device!r}: choose one of {DEVICES}")
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise pytest.UsageError("--device cuda (or TWIN_DEVICE=cuda): torch sees no CUDA GPU on this machine")
    os.environ["TWIN_DEVICE"] = device  # read by tests/helpers/twins.py (twin_device) in this process and its children
