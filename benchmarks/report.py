"""The benchmark's results and how they are shown: figures, ratios, the text and Markdown tables.

A figure is one measured quantity (ms/step, tokens/s, GFLOP/s, s) from the durations of its timed repeats: `min`
is the figure at the fastest repeat and `median` at the median duration (for a time its minimum and median, for
a rate its maximum and median), `seconds` keeps the durations themselves. Ratios compare figures by their
medians, because a median is robust to the odd repeat slowed down by another process on a shared machine, and
are added after both figures exist (`add_ratio`). The tables begin with the machine lines: CPU, cores, memory,
library versions, load, threads and the batch, without which the figures cannot be compared with other runs.

Nothing here measures anything or imports jax or torch.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

# The benchmark's sections, in the order they run and are shown (run.py's --sections chooses among them).
SECTIONS = ("train", "flops", "first-step", "decode", "pmap", "accumulate", "multihost", "gpu")
# What runs without --sections: "gpu" is asked for by name (benchmarks/gpu.sh does), as it repeats the training
# step in every precision and would double a CPU run.
DEFAULT_SECTIONS = SECTIONS[:-1]

SECTION_TITLES = {
    "train": "1. Training step (JAX / other: ms/step < 1 and tokens/s > 1 mean JAX is faster)",
    "flops": "2. Achieved matmul GFLOP/s",
    "first-step": "3. Time to the first step (fresh process)",
    "decode": "4. Decoding",
    "pmap": "5. Data parallel over simulated CPU devices: pmap and sharded jit vs jit",
    "accumulate": "6. Gradient accumulation: K micro-batches in one step vs one step on the whole batch",
    "multihost": "7. Two processes on loopback vs one (sharded jit)",
    "gpu": "8. Precision and frameworks on the accelerator (JAX / other: > 1 means JAX is faster)",
}


def figure(
    name: str,
    unit: str,
    seconds: Sequence[float],
    to_unit: Callable[[float], float] = lambda t: t,
    *,
    section: str,
    preset_name: str | None = None,
    note: str | None = None,
) -> dict[str, Any]:
    """One line of the results from the timed repeats' durations (seconds). `min` is the figure at the fastest
    repeat and `median` at the median duration, both in `unit`: for a time that is the minimum and the median,
    for a rate (tokens/s, GFLOP/s) the fastest repeat gives the highest value. Ratios (of medians) are added
    later with add_ratio."""
    fastest, median = float(min(seconds)), float(statistics.median(seconds))
    return {
        "name": name,
        "section": section,
        "preset": preset_name,
        "unit": unit,
        "min": to_unit(fastest),
        "median": to_unit(median),
        "n": len(seconds),
        "seconds": {"min": fastest, "median": median, "max": float(max(seconds))},
        "higher_is_better": unit.endswith("/s"),  # a rate (tokens/s, GFLOP/s), not a time (ms/step, s)
        "ratios": {},
        "note": note,
    }


def figure_from_summary(
    name: str, unit: str, fastest: float, median: float, n: int, to_unit: Callable[[float], float], **kw
) -> dict[str, Any]:
    """A figure from a fastest and a median duration measured elsewhere (benchmarks/decoding.py)."""
    fig = figure(name, unit, [fastest, median], to_unit, **kw)
    fig.update(median=to_unit(median), n=n, seconds={"min": fastest, "median": median, "max": None})
    return fig


def ratio(a: dict | None, b: dict | None) -> float | None:
    """Median of figure a over median of figure b, or None where one is missing."""
    if a is None or b is None or not b["median"]:
        return None
    return a["median"] / b["median"]


def add_ratio(fig: dict, key: str, value: float | None) -> None:
    if value is not None and value > 0:
        fig["ratios"][key] = value


def _number(x: float) -> str:
    if x >= 100:
        return f"{x:,.0f}"
    if x >= 10:
        return f"{x:.1f}"
    return f"{x:.3g}"


def _ratios(fig: dict) -> str:
    return "; ".join(f"{k} {_number(v)}" for k, v in fig["ratios"].items())


def machine_lines(result: dict) -> list[str]:
    """What the figures were measured on and how: the lines both tables begin with."""
    m, st = result["machine"], result["settings"]
    libs = ", ".join(f"{k} {v}" for k, v in m["libraries"].items())
    gpus = "; ".join(f"{g['name']} ({g['memory']}, driver {g['driver']})" for g in m.get("gpus", [])) or "none"
    return [
        f"machine: {m['cpu_model']} ({', '.join(m['cpu_features'])}), {m['cores']} cores, "
        f"{m['memory_gib']} GiB, {m['os']}",
        f"GPUs: {gpus}",
        f"libraries: {libs}",
        f"date: {m['date']}; load average at start {m['load_average']}, at end {result['load_average_end']}",
        f"threads: torch.set_num_threads({st['torch_threads']}); XLA: its default (all cores)",
        "host memory: "
        + (
            "freed memory kept for reuse in every section, as `train.py train` keeps it on a CPU (translate and "
            "evaluate do not; jax_transformer.training.host_memory)"
            if st.get("freed_memory_kept")
            else "the C library's defaults (freed memory not kept)"
        ),
        f"training batch: {st['batch_size']} rows x {st['length']} tokens (source and target), vocabulary "
        f"{st['vocab']}, dropout 0.1, label smoothing 0.1",
        f"each figure: 'best' at the fastest and 'median' at the median of its n timed repeats (after "
        f"{st['warmup']} untimed warm-up step(s)): for a time the minimum, for a rate the maximum; "
        f"ratios are of medians",
    ]


def text_table(result: dict) -> str:
    """The results as printed at the end of a run: machine lines, then each section's figures and notes."""
    lines = machine_lines(result)
    for section in SECTIONS:
        rows = [f for f in result["figures"] if f["section"] == section]
        if not rows:
            continue
        lines += ["", SECTION_TITLES[section]]
        width = max(len(f["name"]) for f in rows)
        for f in rows:
            lines.append(
                f"  {f['name']:<{width}}  {f['unit']:>15}  best {_number(f['min']):>9}  "
                f"median {_number(f['median']):>9}  (n={f['n']})  {_ratios(f)}"
            )
        notes = sorted({f["note"] for f in rows if f["note"]})
        lines += [f"  note: {n}" for n in notes]
    if result["failures"]:
        lines += ["", "failures:"] + [f"  {f['name']}: {f['error']}" for f in result["failures"]]
    return "\n".join(lines)


def markdown_table(result: dict) -> str:
    """The same as text_table, as Markdown (--markdown; for docs/benchmarks.md)."""
    lines = ["## Benchmarks", ""] + [f"- {line}" for line in machine_lines(result)]
    for section in SECTIONS:
        rows = [f for f in result["figures"] if f["section"] == section]
        if not rows:
            continue
        lines += [
            "",
            f"### {SECTION_TITLES[section]}",
            "",
            "| figure | unit | best | median | n | ratios |",
            "|---|---|---:|---:|---:|---|",
        ]
        for f in rows:
            lines.append(
                f"| {f['name']} | {f['unit']} | {_number(f['min'])} | {_number(f['median'])} | {f['n']} | "
                f"{_ratios(f)} |"
            )
        notes = sorted({f["note"] for f in rows if f["note"]})
        if notes:
            lines += [""] + [f"Note: {n}." for n in notes]
    if result["failures"]:
        lines += ["", "### Failures", ""] + [f"- {f['name']}: `{f['error']}`" for f in result["failures"]]
    return "\n".join(lines) + "\n"
