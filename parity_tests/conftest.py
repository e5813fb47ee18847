"""Shared set-up for the cross-framework parity tests.

Both frameworks compute in float32 (test_bf16_parity.py: both in bfloat16). JAX is told to use full-precision
matmuls ("highest": on CPU this is already the case, on TPU/GPU it turns off bf16/TF32 passes) and PyTorch to use
deterministic kernels without TF32, so the only remaining differences are float32 rounding in different summation
orders. The twin runs on `pytest --device` (conftest.py at the repository root; the CPU by default).

Every check records the largest difference it saw with `parity_report`; the table is printed at the end of the
run (also without -s), so parity is shown as numbers and not only as a pass.

The configurations, batches and twin models themselves come from tests/helpers/ (shared with tests/ and
benchmarks/); this file holds the pytest side: precision settings, the report, the `config_case` fixture.
"""

from __future__ import annotations

import os
import tempfile

import jax
import pytest
import torch

jax.config.update("jax_default_matmul_precision", "highest")
jax.config.update("jax_enable_x64", False)
torch.use_deterministic_algorithms(True)
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
# bfloat16 matmuls accumulate in float32, as XLA's do (cuBLAS may otherwise reduce split sums in bfloat16).
torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))

from tests.helpers.configs import PARITY_CONFIGS  # noqa: E402

_REPORT: list[tuple[str, str, float, float]] = []


@pytest.fixture
def parity_report():
    """report(check, case, observed_max_difference, tolerance): records a figure for the summary table."""

    def report(check: str, case: str, observed: float, tolerance: float) -> None:
        row = (check, case, float(observed), float(tolerance))
        print(f"[parity] {check:<42} {case:<28} max diff {observed:.3e}  (tol {tolerance:.0e})")
        if os.environ.get("PARITY_REPORT_FILE"):  # pytest-xdist's workers: the first process prints the table
            with open(os.environ["PARITY_REPORT_FILE"], "a", encoding="utf-8") as f:
                f.write("\t".join(map(str, row)) + "\n")
        else:
            _REPORT.append(row)

    return report


def pytest_configure(config):
    """Under pytest-xdist, the workers write their figures to one file (they inherit its name), which the first
    process reads for the table."""
    if "PYTEST_XDIST_WORKER" not in os.environ and getattr(config.option, "numprocesses", None):
        if not os.environ.get("PARITY_REPORT_FILE"):
            fd, path = tempfile.mkstemp(prefix="parity-report-", suffix=".tsv")
            os.close(fd)
            os.environ["PARITY_REPORT_FILE"] = path
            config.add_cleanup(lambda: os.path.exists(path) and os.remove(path))


def pytest_terminal_summary(terminalreporter):
    rows = list(_REPORT)
    path = os.environ.get("PARITY_REPORT_FILE")
    if "PYTEST_XDIST_WORKER" not in os.environ and path and os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            for line in f:
                check, case, observed, tolerance = line.rstrip("\n").split("\t")
                rows.append((check, case, float(observed), float(tolerance)))
    if not rows:
        return
    terminalreporter.section("parity: maximum differences measured")
    terminalreporter.write_line(f"{'check':<42} {'case':<28} {'max diff':>10} {'tolerance':>10}")
    for check, case, observed, tolerance in sorted(rows):
        terminalreporter.write_line(f"{check:<42} {case:<28} {observed:>10.3e} {tolerance:>10.0e}")


# --- the configurations every check runs over (tests/helpers/configs.py holds them) ----


@pytest.fixture(params=list(PARITY_CONFIGS), ids=list(PARITY_CONFIGS))
def config_case(request):
    """(name, config) for each of tests/helpers/configs.py's PARITY_CONFIGS."""
    return request.param, PARITY_CONFIGS[request.param]
