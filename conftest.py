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
pretrained models build theirs from configs, and nothing in the suite may reach the network; and one compilation
cache for the session (below).
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

DETERMINISTIC_GPU_FLAG = "--xla_gpu_deterministic_ops=true"
# Unless XLA_FLAGS already names a deterministic-ops flag (benchmarks/gpu.sh falls back to its successor,
# --xla_gpu_exclude_nondeterministic_ops, where an XLA has dropped this one: an unknown flag aborts XLA).
if "deterministic_ops" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {DETERMINISTIC_GPU_FLAG}".strip()
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# One persistent compilation cache for the whole session, in a folder of its own (never the user's cache): the tests
# train, decode and port the same tiny models again and again, in this process, in pytest-xdist's workers (which
# inherit the variable) and in child processes, and each program compiles once. The threshold 0: the tiny models'
# programs compile in under the second jax caches by default. Tests of the cache itself use folders of their own.
if "PYTEST_XDIST_WORKER" not in os.environ:  # the session's first process: the workers share its folder
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jax-transformer-tests-xla-")
    os.environ["JAX_TRANSFORMER_TEST_CACHE"] = os.environ["JAX_COMPILATION_CACHE_DIR"]  # removed at the end
    # Training files are encoded once into this session's corpus cache (token_arrays), never into ~/.cache.
    os.environ["JAX_TRANSFORMER_CACHE"] = tempfile.mkdtemp(prefix="jax-transformer-tests-corpora-")
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"

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


def pytest_unconfigure(config):
    if "PYTEST_XDIST_WORKER" not in os.environ and os.environ.get("JAX_TRANSFORMER_TEST_CACHE"):
        shutil.rmtree(os.environ["JAX_TRANSFORMER_TEST_CACHE"], ignore_errors=True)
        shutil.rmtree(os.environ["JAX_TRANSFORMER_CACHE"], ignore_errors=True)


@pytest.fixture(autouse=True)
def session_compilation_cache():
    """After each test, the process's compilation settings as the session set them (conftest.py's cache on, the
    store of traced decoders off), whatever the test's `train.py` call or `use_cache` left (a test of the cache
    turns it off, a training run turns the store on in its cache folder): no test sees another's."""
    yield
    from jax_transformer import compilation

    compilation.use_cache(None)
