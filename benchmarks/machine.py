"""What the benchmark ran on: CPU model, core counts, memory, GPUs, library versions, date and load; and the
known matmul peaks of some GPUs, for the share of the peak a step reaches (benchmarks/gpu.py).

Nothing here imports jax or torch (versions come from the installed packages' metadata), so the parent process
of the benchmark can describe the machine before deciding what to import.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import shutil
import subprocess
import sys

# The libraries whose versions decide the numbers (jaxlib carries XLA, torch carries MKL/oneDNN).
LIBRARIES = ("jax", "jaxlib", "flax", "optax", "torch", "numpy")


def cpu_model() -> str:
    """The 'model name' line of /proc/cpuinfo (Linux); platform.processor() elsewhere."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


# Instruction-set extensions that matter for float32 matmul speed (the model name alone is often generic).
SIMD_FLAGS = ("avx", "avx2", "fma", "avx512f", "avx512_bf16", "amx_tile")


def cpu_features() -> list[str]:
    """Which of SIMD_FLAGS the CPU reports in /proc/cpuinfo (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return [name for name in SIMD_FLAGS if name in flags]
    except OSError:
        pass
    return []


def core_count() -> int:
    """Logical CPUs this process may run on (the affinity mask, which containers restrict), else os.cpu_count()."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def memory_gib() -> float | None:
    """Total RAM in GiB from /proc/meminfo, or None where there is none."""
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / 2**20, 1)  # the line is in kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def library_versions() -> dict[str, str]:
    """{package: version} for the libraries in LIBRARIES ("not installed" for a missing one) and Python."""
    versions = {"python": platform.python_version()}
    for name in LIBRARIES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


# Libraries that exist only on some machines (JAX's CUDA plugins): listed when installed.
OPTIONAL_LIBRARIES = ("jax-cuda12-plugin", "jax-cuda13-plugin", "jax-cuda12-pjrt", "jax-cuda13-pjrt")


def optional_library_versions() -> dict[str, str]:
    versions = {}
    for name in OPTIONAL_LIBRARIES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return versions


def gpus() -> list[dict[str, str]]:
    """The NVIDIA GPUs `nvidia-smi` lists (name, driver, memory), without importing jax or torch; [] without one."""
    if shutil.which("nvidia-smi") is None:
        return []
    query = ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]
    try:
        lines = subprocess.run(query, capture_output=True, text=True, timeout=30, check=True).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        return []
    fields = [[part.strip() for part in line.split(",")] for line in lines if line.strip()]
    return [{"name": f[0], "driver": f[1], "memory": f[2]} for f in fields if len(f) == 3]


# Dense (no sparsity) peak FLOP/s of the tensor cores, from NVIDIA's data sheets: bfloat16, TF32 and plain float32
# (FP32, the CUDA cores). H100 SXM: 989 / 494.7 / 66.9 TFLOP/s (the data sheet's 1,979 and 989 for bf16 and TF32
# are with 2:4 sparsity); H100 PCIe: 756 / 378 / 51.2; H200 has the H100 SXM's compute; A100: 312 / 156 / 19.5.
# A device whose name matches none of these gets no share of a peak.
KNOWN_PEAKS: dict[str, dict[str, float]] = {
    "H100 PCIe": {"bfloat16": 756e12, "tf32": 378e12, "float32": 51.2e12},
    "H100": {"bfloat16": 989e12, "tf32": 494.7e12, "float32": 66.9e12},  # SXM (the name has no form factor)
    "H200": {"bfloat16": 989e12, "tf32": 494.7e12, "float32": 66.9e12},
    "A100": {"bfloat16": 312e12, "tf32": 156e12, "float32": 19.5e12},
}


def known_peak(device_name: str) -> tuple[str, dict[str, float]] | None:
    """(table key, peaks) for a device name such as "NVIDIA H100 80GB HBM3"; None if the table has none."""
    for key, peaks in KNOWN_PEAKS.items():  # "H100 PCIe" is tried before "H100"
        if all(word in device_name for word in key.split()):
            if key == "H100" and "NVL" in device_name:  # another board with other clocks: not in the table
                return None
            return key, peaks
    return None


def load_average() -> list[float] | None:
    """1, 5 and 15 minute load averages: how busy the (possibly shared) machine was."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def machine_info() -> dict:
    """A JSON-able description of this machine and software."""
    return {
        "cpu_model": cpu_model(),
        "cpu_features": cpu_features(),
        "cores": core_count(),
        "logical_cpus": os.cpu_count(),
        "memory_gib": memory_gib(),
        "os": f"{platform.system()} {platform.release()}",
        "python_executable": sys.executable,
        "libraries": {**library_versions(), **optional_library_versions()},
        "gpus": gpus(),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "load_average": load_average(),
    }


if __name__ == "__main__":
    import json

    print(json.dumps(machine_info(), indent=2))
