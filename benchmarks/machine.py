"""What the benchmark ran on: CPU model, core counts, memory, library versions, date and load.

Nothing here imports jax or torch (versions come from the installed packages' metadata), so the parent process
of the benchmark can describe the machine before deciding what to import.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
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
        "libraries": library_versions(),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "load_average": load_average(),
    }


if __name__ == "__main__":
    import json

    print(json.dumps(machine_info(), indent=2))
