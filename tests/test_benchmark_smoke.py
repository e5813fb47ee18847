"""Smoke test of the benchmark harness (benchmarks/run.py) and a check of its FLOP formula (benchmarks/flops.py).

The harness runs in a subprocess on the tiny preset for one repetition of its cheap sections (train, flops) and of
the gpu section (benchmarks/gpu.py, which benchmarks/gpu.sh runs on a GPU machine: here on the CPU, where it must
run as well), and the JSON it writes must have the promised structure. Nothing here asserts a speed: timings
belong to the benchmark's output, not to tests. Also: benchmarks/gpu.sh is valid bash and every command it would
run passes run.py's argument checks (`--dry-run`).
"""

import json
import math
import random
import re
import shlex
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

import pytest

from jax_transformer.settings.config import preset

REPO = Path(__file__).resolve().parent.parent
RUN = REPO / "benchmarks" / "run.py"
JAX = "JAX jit"
TORCH_DEFAULT = "torch eager, Adam (default: for-loop on CPU)"
TORCH_FUSED = "torch eager, Adam(fused=True)"
pytestmark = pytest.mark.slow  # every test here runs a benchmark in child processes


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("benchmark")
    cmd = [
        sys.executable,
        str(RUN),
        "--presets",
        "tiny",
        "--sections",
        "train,flops,gpu",
        "--quick",  # the gpu section: no torch.compile, compilation cold/warm in bfloat16 only
        "--aux-presets",
        "tiny",
        "--decode-batch-sizes",
        "2",
        "--decode-new-tokens",
        "3",
        "--repeats",
        "1",
        "--warmup",
        "1",
        "--torch-variants",
        "default,fused",
        "--vocab",
        "64",
        "--batch-size",
        "8",
        "--length",
        "8",
        "--peak-size",
        "128",
        "--json",
        str(out / "b.json"),
        "--markdown",
        str(out / "b.md"),
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"benchmark failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return {
        "json": json.loads((out / "b.json").read_text()),
        "markdown": (out / "b.md").read_text(),
        "stdout": proc.stdout,
    }


def test_json_describes_the_machine(smoke):
    machine = smoke["json"]["machine"]
    assert isinstance(machine["cpu_model"], str) and machine["cpu_model"]
    assert isinstance(machine["cores"], int) and machine["cores"] >= 1
    for library in ("jax", "flax", "optax", "torch", "numpy"):
        assert machine["libraries"][library] not in ("", "not installed")
    assert machine["date"][:2] == "20"  # ISO date
    assert smoke["json"]["settings"]["torch_threads"] == machine["cores"]


def test_every_figure_has_name_unit_min_median(smoke):
    figures = smoke["json"]["figures"]
    assert figures
    for f in figures:
        assert isinstance(f["name"], str) and f["name"]
        assert isinstance(f["unit"], str) and f["unit"]
        assert _positive(f["min"]) and _positive(f["median"]), f
        # "min" is the figure at the fastest repeat: the lowest time, or the highest rate.
        assert (f["min"] >= f["median"]) if f["higher_is_better"] else (f["min"] <= f["median"]), f
        assert f["higher_is_better"] == (f["unit"] in ("target tokens/s", "GFLOP/s", "TFLOP/s", "tokens/s")), f
        assert f["n"] >= 1
        assert all(_positive(v) for v in f["ratios"].values()), f
    assert smoke["json"]["failures"] == []


def test_train_section_has_each_framework_and_jax_ratios(smoke):
    figures = {f["name"]: f for f in smoke["json"]["figures"]}
    for kind in ("train step", "train throughput"):
        for label in (JAX, TORCH_DEFAULT, TORCH_FUSED):
            assert f"{kind} tiny: {label}" in figures
        ratios = figures[f"{kind} tiny: {JAX}"]["ratios"]
        assert set(ratios) == {f"JAX/{TORCH_DEFAULT}", f"JAX/{TORCH_FUSED}"}
        # The ratio is of medians: recompute it from the two figures.
        other = figures[f"{kind} tiny: {TORCH_FUSED}"]["median"]
        assert ratios[f"JAX/{TORCH_FUSED}"] == pytest.approx(figures[f"{kind} tiny: {JAX}"]["median"] / other)
    assert figures[f"train step tiny: {JAX}"]["unit"] == "ms/step"
    assert figures[f"train throughput tiny: {JAX}"]["unit"] == "target tokens/s"
    assert f"first call (compile + step) tiny: {JAX}" in figures


def test_flops_section_reports_utilisation_and_cross_checks(smoke):
    figures = {f["name"]: f for f in smoke["json"]["figures"]}
    assert "matmul peak: jnp.dot 128x128 float32" in figures
    assert "matmul peak: torch.mm 128x128 float32" in figures
    jax_fig = figures[f"achieved tiny: {JAX}"]
    assert jax_fig["unit"] == "GFLOP/s"
    assert {"% of jnp.dot peak", "% of torch.mm peak", "XLA flops/analytic"} <= set(jax_fig["ratios"])
    # The analytic formula counts exactly the dot_general FLOPs of the traced step.
    assert jax_fig["ratios"]["traced matmul/analytic"] == pytest.approx(1.0, rel=1e-9)


def test_markdown_and_stdout_hold_the_table(smoke):
    assert "| figure | unit | best | median | n | ratios |" in smoke["markdown"]
    for f in smoke["json"]["figures"]:
        assert f["name"] in smoke["markdown"]
        assert f["name"] in smoke["stdout"]
    assert smoke["json"]["machine"]["cpu_model"] in smoke["stdout"]


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        dict(num_encoder_layers=1, num_decoder_layers=3, d_ff=48, tie_output=False),
        dict(norm_first=True, final_norm=True, tgt_vocab_size=50),
    ],
)
def test_flop_formula_matches_the_traced_step(overrides):
    """train_step_matmul_flops (from the shapes) against the dot_general ops jax traces for one step, with
    source and target lengths that differ so that S and T cannot be swapped unnoticed."""
    from benchmarks.flops import traced_train_step_matmul_flops, train_step_matmul_flops

    config = preset("tiny", **{"src_vocab_size": 60, "tgt_vocab_size": 60, **overrides})
    B, S, T = 3, 7, 5
    traced = traced_train_step_matmul_flops(config, B, S, T)
    assert traced == pytest.approx(train_step_matmul_flops(config, B, S, T)["train_step"], rel=1e-12)


# On a CPU: no "JAX float32 highest" (CPU float32 is full precision already), no torch TF32; with --quick no
# torch.compile and no attention-kernel A/B (on a GPU: "JAX bfloat16 + cudnn", with the ratio kernel/explicit).
GPU_JAX = ("JAX float32", "JAX bfloat16")
GPU_TORCH = ("torch float32", "torch bf16 autocast", "torch bf16 twin")


def test_gpu_section_has_every_precision_both_frameworks_and_the_ratios(smoke):
    import jax

    from benchmarks.machine import known_peak

    on_gpu = jax.default_backend() == "gpu"  # the benchmark's child process sees the same devices
    figures = {f["name"]: f for f in smoke["json"]["figures"] if f["section"] == "gpu"}
    for label in GPU_JAX + GPU_TORCH:
        for kind, unit in (("step", "ms/step"), ("throughput", "target tokens/s"), ("matmul", "TFLOP/s")):
            assert figures[f"gpu tiny {kind}: {label}"]["unit"] == unit
    rates = {label: figures[f"gpu tiny throughput: {label}"] for label in GPU_JAX + GPU_TORCH}
    assert rates["JAX bfloat16"]["ratios"]["JAX bfloat16/JAX float32"] == pytest.approx(
        rates["JAX bfloat16"]["median"] / rates["JAX float32"]["median"]
    )
    # JAX against the twin's fastest mode of the same matmul precision (bfloat16: autocast or the bf16 twin).
    fastest = max(("torch bf16 autocast", "torch bf16 twin"), key=lambda label: rates[label]["median"])
    assert f"JAX/{fastest}" in rates["JAX bfloat16"]["ratios"]
    # JAX's float32 against the twin's of the same matmul precision: TF32 on a GPU (XLA's default there)
    assert f"JAX/torch {'TF32' if on_gpu else 'float32'}" in rates["JAX float32"]["ratios"]
    # A share of the device's peak where one is known (on an H100 each TFLOP/s figure carries "% of H100 ... peak");
    # none on a CPU.
    shares = [key for f in figures.values() for key in f["ratios"] if key.startswith("%")]
    assert bool(shares) == bool(on_gpu and known_peak(jax.devices()[0].device_kind)), shares
    for dtype in ("float32", "bfloat16"):  # greedy only with --quick (beam 4 too in a full run)
        assert figures[f"gpu decode tiny batch 2: JAX greedy {dtype}"]["unit"] == "tokens/s"
    assert "JAX/torch greedy bfloat16" in figures["gpu decode tiny batch 2: JAX greedy bfloat16"]["ratios"]
    cold = figures["gpu tiny compile train step bfloat16: cold cache"]
    assert "cold/warm" in cold["ratios"] and "gpu tiny compile train step bfloat16: warm cache" in figures
    # The cold process wrote the persistent compilation cache that the warm one read.
    assert int(cold["note"].rsplit("persistent cache files after the cold run: ", 1)[1]) >= 1


def test_gpu_script_is_valid_and_its_benchmark_commands_parse(tmp_path):
    """bash -n on benchmarks/gpu.sh; `gpu.sh --dry-run` prints every part's commands without running them, each
    benchmarks/run.py command among them is accepted by run.py's own argument parser, and the caps of the parts
    fit one call of the device tool (10 minutes, a default budget of 560 s for the parts)."""
    from benchmarks.run import parse_args

    script = REPO / "benchmarks" / "gpu.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    proc = subprocess.run(["bash", str(script), "--dry-run"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = [line.split("benchmarks/run.py", 1)[1] for line in proc.stdout.splitlines() if "benchmarks/run.py" in line]
    assert len(lines) == 3  # the 600M step (JAX and the twin eager), under torch.compile, and the base step
    for line in lines:
        parse_args(shlex.split(line))  # exits (SystemExit) on a flag or value run.py does not accept
    for part in ("# suite", "# train-600m", "# train-600m-compile", "# train-base", "# ctranslate2", "# multi30k"):
        assert part in proc.stdout
    assert "pytest -q -n 12 --dist worksteal --device cuda" in proc.stdout
    assert "benchmarks/multi30k.py time-to-bleu --data /tmp/multi30k --minutes 2.2" in proc.stdout
    listing = subprocess.run(["bash", str(script), "list"], cwd=REPO, capture_output=True, text=True, timeout=60)
    caps = [int(line.split()[1]) for line in listing.stdout.splitlines() if not line.startswith("default plan")]
    assert len(caps) == 6 and max(caps) <= 560, listing.stdout  # each part fits one device call and its budget


def test_multi30k_benchmark_runs_the_multi30k_recipe_and_splits_old_runs_by_phase():
    """benchmarks/multi30k.py runs the `multi30k` recipe written out as flags (the old code has no --recipe): train.py
    parses them to exactly the recipe's settings, only --max-minutes changed; and its phase split of a run without
    a summary record adds up to the wall time."""
    from benchmarks import multi30k
    from jax_transformer.settings.config import RECIPES

    ours = multi30k.readme_flags(Path("/data"), Path("/run"), 7)
    assert ours[-1] == "--no-progress"
    sys.path.insert(0, str(REPO))
    try:
        from jax_transformer.cli import main as cli
    finally:
        sys.path.remove(str(REPO))
    args = cli.build_parser().parse_args(ours)
    assert args.func is cli.COMMANDS["train"].run and getattr(args, "loop.max_minutes") == 7.0
    recipe = RECIPES["multi30k"]
    assert args.preset == recipe["preset"]
    for group in ("model", "data", "optim", "loop"):
        for field, value in recipe[group].items():
            if field != "max_minutes":
                assert getattr(args, f"{group}.{field}") == value, (group, field)

    # A run of 4 steps at 1 s, an evaluation at step 2 with 0.5 s of compilation inside it, 10 s of wall time.
    records = [{"kind": "train", "step": s, "elapsed_s": t} for s, t in ((1, 3.0), (2, 4.0), (3, 6.0), (4, 7.0))]
    records.insert(2, {"kind": "eval", "step": 2, "elapsed_s": 5.0})
    lines = [
        (4.5, "Finished XLA compilation of jit(start) in 0.5 sec"),
        (1.5, "Finished tracing f for jit in 1 sec"),
    ]
    phases = multi30k.estimated_phases(records, lines, wall=10.0)
    assert phases["eval_s"] == pytest.approx(0.5) and phases["compile_s"] == pytest.approx(1.5)
    assert sum(v for k, v in phases.items() if k != "estimated") == pytest.approx(10.0)


def test_bf16_decoding_benchmark_counts_identical_sentences():
    """benchmarks/bf16_decoding.py on a few sentences of a saved model: its rows count identical outputs (here all
    of them: the frameworks and the dtypes agree on these sentences) and its Markdown table shows them."""
    import dataclasses

    from benchmarks import bf16_decoding
    from tests.helpers.saved import load_saved_model

    saved = load_saved_model("trained_tiny")
    saved = dataclasses.replace(saved, sources=saved.sources[:4], source_texts=saved.source_texts[:4])
    rows = bf16_decoding.compare(saved, paths=("greedy batch 1", "beam 4 without cache"), with_verify=False)
    assert [row["path"] for row in rows] == ["greedy batch 1", "beam 4 without cache"]
    for row in rows:
        assert row["sentences"] == 4
        assert all(row[column] == 4 for column in bf16_decoding.COLUMNS), row
    table = bf16_decoding.markdown("trained_tiny", rows)
    assert "| greedy batch 1 | 4 | 4 | 4 | 4 |" in table


def test_ctranslate2_benchmark_runs_both_engines_on_the_same_weights():
    """benchmarks/ctranslate2_decoding.py on the tiny shape: the model goes through the transformers export and
    CTranslate2's converter, each decoder gives a row per search, and the engines give the same tokens (every output
    has the same length, so no length rule can part them; with random weights a near-tie flipping a token needs a
    logit gap below the engines' float32 difference, ~1e-6)."""
    pytest.importorskip("ctranslate2")
    pytest.importorskip("transformers")
    from benchmarks import ctranslate2_decoding as bench

    report = bench.benchmark(
        "tiny", ["greedy:2", "beam4:2"], new_tokens=6, src_len=5, vocab=300, repeats=1, log=lambda line: None
    )
    rows = report["results"]
    assert [(r["search"], r["decoder"]) for r in rows] == [
        (search, decoder) for search in ("greedy", "beam4") for decoder in ("flax", "flax-generate", "ctranslate2")
    ]
    for row in rows:
        assert row["batch"] == 2 and _positive(row["seconds_min"]) and row["seconds_min"] <= row["seconds_median"]
        assert row["same_as_ctranslate2"] == "2/2", row
        # CPU time over wall time. No upper bound here: over calls of a millisecond or two, the CPU time that other
        # threads spend in the window (CTranslate2's OpenMP workers spinning down after its call) weighs too much.
        assert _positive(row["cores_used"]), row
    assert report["settings"]["ctranslate2"] and report["machine"]["cpu_model"]
    assert "| beam4 | 2 | ctranslate2 |" in bench.table(report)
    # The decoders asked for, the Flax model in bfloat16 beside CTranslate2 in float32
    mixed = dict(dtype="bfloat16", ct2_compute_type="float32", names=("flax", "ctranslate2"), log=lambda line: None)
    report = bench.benchmark("tiny", ["greedy:2"], new_tokens=6, src_len=5, vocab=300, repeats=1, **mixed)
    assert [r["decoder"] for r in report["results"]] == ["flax", "ctranslate2"]
    settings = report["settings"]
    assert [settings[k] for k in ("flax_dtype", "ctranslate2_compute_type", "ctranslate2_device")] == [
        "bfloat16",
        "float32",
        "cpu",
    ]
    assert settings["decoders"] == ["flax", "ctranslate2"]
    # int8 rows beside CTranslate2's int8, the float32 row compared with it too
    names = ("flax", "flax-int8", "ctranslate2-int8")
    report = bench.benchmark(
        "tiny", ["greedy:2"], new_tokens=6, src_len=5, vocab=300, repeats=1, names=names, log=lambda line: None
    )
    assert [r["decoder"] for r in report["results"]] == list(names)
    assert report["settings"]["ctranslate2_compute_type"].startswith("int8"), report["settings"]
    assert "| greedy | 2 | flax-int8 |" in bench.table(report)
    assert all(_positive(r["seconds_min"]) and r["same_as_flax"] is not None for r in report["results"])


_HLO = """HloModule step

%fused_computation.1 (p0: f32[4,8]) -> f32[4,8] {
  %p0 = f32[4,8]{1,0} parameter(0)
  ROOT %exponential.1 = f32[4,8]{1,0} exponential(%p0), metadata={op_name="jit(step)/decode/log_softmax/exp"}
}

ENTRY %main (a: f32[4,8], b: f32[8,8]) -> f32[4,8] {
  %a = f32[4,8]{1,0} parameter(0)
  %b = f32[8,8]{1,0} parameter(1)
  %ynn_fusion.3 = f32[4,8]{1,0} fusion(%a, %b), kind=kCustom, calls=%fused_computation.9
  %loop_fusion.2 = f32[4,8]{1,0} fusion(%ynn_fusion.3), kind=kLoop, calls=%fused_computation.1
  %copy.7 = f32[8,8]{1,0} copy(%b)
  %multiply.4 = f32[8,8]{1,0} multiply(%copy.7, %copy.7), metadata={op_name="jit(step)/optimizer/mul"}
  ROOT %add.5 = f32[4,8]{1,0} add(%loop_fusion.2, %a), metadata={op_name="jit(step)/layer_0/Dropout_1/mul"}
}
"""


def test_step_profile_sorts_ops_into_categories_by_their_source_names():
    """The training-step profile (benchmarks/step_profile.py) names each op's category from the HLO: a fusion by
    the op names of what is fused into it; matmul fusions by their kind."""
    from benchmarks.step_profile import category, hlo_ops

    ops = hlo_ops(_HLO)
    got = {
        name: category(name, ops[name]) for name in ("ynn_fusion.3", "loop_fusion.2", "copy.7", "multiply.4", "add.5")
    }
    assert got == {
        "ynn_fusion.3": "matmul",
        "loop_fusion.2": "softmax/LayerNorm",  # from the exponential fused into it
        "copy.7": "copies",
        "multiply.4": "optimizer",
        "add.5": "dropout",
    }


def test_step_profile_traces_the_tiny_step():
    """One traced run on the tiny preset: every category is reported, matmuls take time, the rates are finite."""
    import jax

    from benchmarks.step_profile import CATEGORIES, profile_preset

    if jax.default_backend() != "cpu":  # a GPU's trace names its kernels, not XLA:CPU's ops: refused, saying so
        with pytest.raises(RuntimeError, match="XLA:CPU's op events"):
            profile_preset("tiny", 4, 8, steps=2, vocab=64, log=lambda _: None)
        return
    row = profile_preset("tiny", 4, 8, steps=2, vocab=64, log=lambda _: None)
    assert set(row["op_ms"]) == set(CATEGORIES)
    assert row["op_ms"]["matmul"] > 0 and row["op_ms"]["optimizer"] > 0
    assert _positive(row["wall_ms_median"]) and _positive(row["matmul_gflops_in_ops"])


def test_the_corpus_scale_benchmark_makes_the_corpus_it_describes(tmp_path):
    """benchmarks/corpus_scale.py's synthetic corpus: source<TAB>target lines of 5-25 words a side, the same file
    from the same seed, another from another; and the reader of this project reads it whole."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import corpus_scale
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    from jax_transformer.data.corpus import read_tsv

    paths = [tmp_path / name for name in ("a.tsv", "b.tsv", "c.tsv")]
    sizes = [corpus_scale.make_tsv(path, 2_000, seed) for path, seed in zip(paths, (3, 3, 4))]
    assert sizes[0] == paths[0].stat().st_size and paths[0].read_bytes() == paths[1].read_bytes()
    assert paths[0].read_bytes() != paths[2].read_bytes()
    corpus = read_tsv(paths[0], on_empty="error")
    assert len(corpus) == 2_000 and corpus.line_numbers == list(range(1, 2_001))
    counts = [len(text.split(" ")) for text in corpus.sources + corpus.targets]
    assert min(counts) >= 5 and max(counts) <= 25 and len(set(counts)) == 21  # every length of 5..25 occurs


# A few German sentences of our own, so the markup corpus needs no shared data.
MARKUP_SENTENCES = [
    "Ein Mann schläft in einem grünen Raum auf einem Sofa.",
    "Zwei Hunde und eine Katze spielen im Garten.",
    "Die Frau liest ein Buch und trinkt Kaffee.",
    "Kinder laufen über die Wiese zum See.",
    "Ein Junge mit Kopfhörern sitzt auf den Schultern einer Frau.",
    "Wir haben gestern Abend lange und gut gegessen.",
    "Tom und Maria wohnen in einer kleinen Stadt.",
    "Der Zug kommt heute später an.",
]
INLINE = {"b", "i", "em", "strong", "a", "span", "sub", "sup"}
BLOCKS = {"title", "h1", "p", "li", "td"}


def _words(block) -> list[tuple[str, object]]:
    """The translatable words of an html5lib block element, each with the element it lies wholly in (None if
    none): code and translate="no" left out, as the corpus promises."""
    chars, owners = [], []

    def add(text, owner):
        chars.extend(text or "")
        owners.extend([owner] * len(text or ""))

    def walk(element, owner):
        add(element.text, owner)
        for child in element:
            if child.tag != "code" and child.get("translate") != "no":
                walk(child, child if child.tag in INLINE else owner)
            add(child.tail, owner)

    walk(block, None)
    text = "".join(chars)
    out = []
    for match in re.finditer(r"\S+", text):  # \xa0 (from &nbsp;) separates words, as str.split() does
        inside = set(owners[match.start() : match.end()])
        out.append((match.group(), inside.pop() if len(inside) == 1 else None))
    return out


def test_markup_corpus_sidecar_names_the_words_its_tags_wrap():
    """benchmarks/markup_corpus.py: every one-word inline tag of the sidecar is, in the spec's reading of the HTML
    (html5lib), an element of that name around that word at that place of that block; every such element is in the
    sidecar; the same seed gives the same documents; malformed documents parse and list their damage."""
    import html5lib

    from benchmarks.markup_corpus import corpus, make_document, make_xliff

    documents = corpus(MARKUP_SENTENCES, 4, seed=5)
    assert [d.html for d in documents] == [d.html for d in corpus(MARKUP_SENTENCES, 4, seed=5)]
    assert [d.html for d in documents] != [d.html for d in corpus(MARKUP_SENTENCES, 4, seed=6)]
    assert sum(len(d.tags) for d in documents) >= 10
    for doc in documents:
        tree = html5lib.parse(doc.html, namespaceHTMLElements=False)
        blocks = [e for e in tree.iter() if e.tag in BLOCKS]
        assert len(blocks) == len(doc.blocks)
        wrapped = []
        for index, block in enumerate(blocks):
            words = _words(block)
            assert [w for w, _ in words] == doc.blocks[index]["text"].split()
            owned = Counter(owner for _, owner in words if owner is not None)
            wrapped += [(index, owner, w) for w, owner in words if owner is not None and owned[owner] == 1]
        for tag in doc.tags:
            word, owner = _words(blocks[tag["block"]])[tag["word_index"]]
            assert word == tag["word"] and owner is not None and owner.tag == tag["tag"], tag
        assert len(wrapped) == len(doc.tags)
        for raw in doc.opaque:
            assert raw in doc.html
    html, tags = make_document(MARKUP_SENTENCES[:2], random.Random(0))  # a short list is reused
    assert html.startswith("<!") and all(t["word"] in html for t in tags)
    bad = corpus(MARKUP_SENTENCES, 6, seed=1, malformed=True)
    assert all(d.damage for d in bad)
    for d in bad:
        html5lib.parse(d.data, namespaceHTMLElements=False)
    xml, g_tags = make_xliff(MARKUP_SENTENCES, random.Random(0))
    units = {u.get("id"): u for u in ET.fromstring(xml).iter("{urn:oasis:names:tc:xliff:document:1.2}trans-unit")}
    assert len(units) == len(MARKUP_SENTENCES) and g_tags
    for g in g_tags:
        source = units[g["unit"]].find("{urn:oasis:names:tc:xliff:document:1.2}source")
        found = [e for e in source if e.get("id") == g["id"]]
        assert found and found[0].text == g["word"]


def test_markup_parser_comparison_runs_and_reports_every_parser(tmp_path):
    """benchmarks/markup_parsers.py on three documents: every parser timed on both sets, html5lib agrees with itself,
    and html.parser's events all match their source slices."""
    from benchmarks import markup_parsers
    from benchmarks.markup_corpus import corpus

    sentences = tmp_path / "s.de"
    sentences.write_text("\n".join(MARKUP_SENTENCES) + "\n", encoding="utf-8")
    out = tmp_path / "parsers.json"
    args = ["--documents", "3", "--repeats", "1", "--no-memory", "--sentences", str(sentences), "--json", str(out)]
    markup_parsers.main(args)
    results = json.loads(out.read_text())
    for name in markup_parsers.SETS:
        for parser in markup_parsers.PARSERS:
            assert _positive(min(results["speed_mb_per_s"][name][parser]["parse"]))
        assert results["elements"][name]["html5lib"]["same_elements"] == 3
    documents = [d.data for d in corpus(MARKUP_SENTENCES, 3, seed=0, malformed=True)]
    right, total = markup_parsers.stdlib_positions(documents)
    assert total > 100 and right == total
