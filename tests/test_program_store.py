"""The store of decoding programs (compilation.ProgramStore): a program read back runs untraced and decodes what
the jitted one decodes; its key changes with everything the program is traced from; a damaged file is traced again
and a program that cannot be exported runs as before. Traces are counted (jax.monitoring events), never timed."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_transformer import compilation
from jax_transformer.decoding import decoders, schedule
from jax_transformer.model.transformer import init_params
from tests.helpers.batches import make_src
from tests.helpers.configs import DECODING_CONFIGS
from tests.helpers.tooling import compiled_functions
from tests.helpers.training import REPO

DECODERS = ("encoder", "start", "resume")  # as jax names them in its trace events
SCHEDULE = schedule.Scheduled()


@contextlib.contextmanager
def traced_functions() -> Iterator[list[str]]:
    """The names of the functions jax traces inside the block (its trace-duration events)."""
    names: list[str] = []

    def listen(event: str, seconds: float, **kwargs) -> None:
        if event == "/jax/core/compile/jaxpr_trace_duration":
            names.append(str(kwargs.get("fun_name")))

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield names
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


def _searches(params, config, src) -> dict[str, tuple]:
    """Searches that store programs: this project's greedy and beam search, and transformers' rules' beam search
    (whose rules are another class), each through the CPU's schedule (programs that start and go on)."""
    return {
        "greedy": decoders.greedy_search(params, config, src, schedule=SCHEDULE),
        "beam 3": decoders.beam_search(params, config, src, beam_size=3, alpha=0.6, schedule=SCHEDULE),
        "generate beam 2": (decoders.generate(params, config, src, max_length=12, num_beams=2, schedule=SCHEDULE),),
    }


def _assert_same(got: dict, expected: dict) -> None:
    for name in expected:
        for a, b in zip(got[name], expected[name], strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)  # one program: bit for bit


@pytest.fixture
def compilation_cache(tmp_path):
    """JAX's persistent compilation cache in a folder of the test's, every program kept (as `translate` runs the
    store: a program read back compiles from it), the store off; both off afterwards."""
    threshold = jax.config.values["jax_persistent_cache_min_compile_time_secs"]
    compilation.use_cache(str(tmp_path / "xla"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    yield
    jax.config.update("jax_persistent_cache_min_compile_time_secs", threshold)
    compilation.use_cache(compilation.OFF)


@pytest.mark.slow
def test_a_stored_decoder_runs_untraced_and_decodes_the_same(tmp_path, monkeypatch, compilation_cache):
    config = DECODING_CONFIGS["pre_learned_shared"]
    params, src = init_params(config, 0), make_src(config, [3, 7, 5, 2, 6], seed=0)
    expected = _searches(params, config, src)  # the jitted programs, no store

    folder = tmp_path / "programs"
    first = compilation.ProgramStore(folder)
    monkeypatch.setattr(compilation, "_programs", first)
    _assert_same(_searches(params, config, src), expected)
    written = first.counts["written"]  # at least one program of each: the encoder, the three searches
    assert written >= 4 and first.counts["read"] == 0 and first.counts["not saved"] == 0
    assert len(list(folder.glob("*.jax_exported"))) == written

    # A new store, as in the next process: every program is read back, none written, and none of the decoders'
    # jitted functions is asked for (each would be traced in a new process), nor traced.
    second = compilation.ProgramStore(folder)
    monkeypatch.setattr(compilation, "_programs", second)

    def not_here(self, dtype):
        raise AssertionError(f"{self.__name__} traced, not read from the store")

    monkeypatch.setattr(compilation.jit_by_config, "_for", not_here)
    with traced_functions() as traced:
        _assert_same(_searches(params, config, src), expected)
    assert second.counts == {"read": written, "written": 0, "not saved": 0}
    assert not set(traced) & set(DECODERS), traced


@flax.struct.dataclass
class _Unregistered:  # a pytree node class that jax.export cannot serialize (not compilation.exportable)
    value: jnp.ndarray


@dataclasses.dataclass(frozen=True)
class _Config:  # what jit_by_config reads of a config: its dtype (static, hashed)
    dtype: str = "float32"
    scale: float = 2.0


@functools.partial(compilation.jit_by_config, static_argnames=("config",))
def _scaled(x, *, config):
    return x * config.scale


@functools.partial(compilation.jit_by_config, static_argnames=("config", "times"))
def _scaled_by(x, *, config, times):
    return x * times


@functools.partial(compilation.jit_by_config, static_argnames=("config",))
def _wrapped(x, *, config):
    return _Unregistered(x + 1)


def test_the_key_changes_with_what_the_program_is_traced_from(tmp_path, monkeypatch):
    store = compilation.ProgramStore(tmp_path)
    x = np.ones((2, 3), np.float32)

    def key(fn=_scaled._fn, dynamic=((x,), {}), static=None, options=None) -> str:
        return store.key(fn, dynamic, static or {"config": _Config()}, options)

    same = key()
    assert key() == same and key(dynamic=((np.zeros((2, 3), np.float32),), {})) == same  # values are not keyed
    assert key(dynamic=((jax.device_put(x),), {})) == same  # nor where an array is (the program holds it on one)
    assert key(dynamic=((jax.ShapeDtypeStruct((2, 3), np.float32),), {})) == same  # a compile-ahead job's shapes
    others = {
        "shape": key(dynamic=((np.ones((3, 2), np.float32),), {})),
        "dtype": key(dynamic=((np.ones((2, 3), np.int32),), {})),
        "weak type": key(dynamic=((jax.ShapeDtypeStruct((2, 3), np.float32, weak_type=True),), {})),
        "tree": key(dynamic=(([x],), {})),
        "static argument": key(static={"config": _Config(scale=3.0)}),
        "function": key(fn=_wrapped._fn),
        "compile options": key(options={"xla_cpu_copy_insertion_use_region_analysis": True}),
    }
    # A setting of the calling thread, other than the one in force (the parity tests set "highest" for all).
    other = "bfloat16" if jax.config.values["jax_default_matmul_precision"] != "bfloat16" else "highest"
    with jax.default_matmul_precision(other):
        others["matmul precision"] = key()
    monkeypatch.setattr(compilation, "_package_digest", lambda: "another source")
    others["package source"] = compilation.ProgramStore(tmp_path).key(
        _scaled._fn, ((x,), {}), {"config": _Config()}, None
    )
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=false")
    others["XLA_FLAGS"] = compilation.ProgramStore(tmp_path).key(_scaled._fn, ((x,), {}), {"config": _Config()}, None)
    assert [name for name, other in others.items() if other == same] == []
    assert len(set(others.values())) == len(others), others

    # Static arguments other than the config are keyed and not passed to the stored program.
    monkeypatch.setattr(compilation, "_programs", store)
    np.testing.assert_array_equal(np.asarray(_scaled_by(x, config=_Config(), times=3.0)), 3 * x)
    np.testing.assert_array_equal(np.asarray(_scaled_by(x, config=_Config(), times=4.0)), 4 * x)
    assert store.counts["written"] == 2


@contextlib.contextmanager
def cache_lookups() -> Iterator[list[str]]:
    """ "hit" or "miss" for each look-up in jax's persistent compilation cache inside the block."""
    found: list[str] = []

    def listen(event: str, **kwargs) -> None:
        if event in ("/jax/compilation_cache/cache_hits", "/jax/compilation_cache/cache_misses"):
            found.append("hit" if event.endswith("hits") else "miss")

    jax.monitoring.register_event_listener(listen)
    try:
        yield found
    finally:
        jax.monitoring.unregister_event_listener(listen)


def test_a_program_compiled_ahead_from_shapes_is_the_one_later_calls_run(tmp_path, monkeypatch, compilation_cache):
    """A training run compiles its decoders ahead from their arguments' shapes (`jit_by_config.compile_ahead`)
    and calls them later with arrays: a call finds its program compiled, and neither traces nor
    compiles it, whether its arrays are numpy's or placed on the device. The next process (a `translate` after the
    training run) reads the program and finds its compiled form in jax's persistent cache: no compile either."""
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    store = compilation.ProgramStore(tmp_path / "programs")
    monkeypatch.setattr(compilation, "_programs", store)
    with cache_lookups() as lookups:
        _scaled.compile_ahead(jax.ShapeDtypeStruct(x.shape, x.dtype), config=_Config())
    assert lookups == ["miss"] and store.counts == {"read": 0, "written": 1, "not saved": 0}
    arrays = (x, jax.device_put(x), jnp.asarray(x))
    with traced_functions() as traced, compiled_functions() as compiled:
        for arg in arrays:
            np.testing.assert_array_equal(np.asarray(_scaled(arg, config=_Config())), 2 * x)
    assert traced == [] and compiled == []

    store = compilation.ProgramStore(tmp_path / "programs")
    monkeypatch.setattr(compilation, "_programs", store)
    with cache_lookups() as lookups:
        np.testing.assert_array_equal(np.asarray(_scaled(jax.device_put(x), config=_Config())), 2 * x)
    assert lookups == ["hit"] and store.counts == {"read": 1, "written": 0, "not saved": 0}
    # Called inside another jit (tracers, which the compiled program cannot take): the plain jit, traced within.
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda a: _scaled(a, config=_Config()))(x)), 2 * x)


def test_a_damaged_program_is_traced_again_and_one_that_cannot_be_exported_runs_as_before(tmp_path, monkeypatch):
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    warnings: list[str] = []
    monkeypatch.setattr(compilation, "_programs", compilation.ProgramStore(tmp_path, warnings.append))
    np.testing.assert_array_equal(np.asarray(_scaled(x, config=_Config())), 2 * x)
    (path,) = tmp_path.glob("*.jax_exported")
    path.write_bytes(b"not a program")  # a truncated or foreign file

    store = compilation.ProgramStore(tmp_path, warnings.append)
    monkeypatch.setattr(compilation, "_programs", store)
    np.testing.assert_array_equal(np.asarray(_scaled(x, config=_Config())), 2 * x)
    np.testing.assert_array_equal(np.asarray(_scaled(x, config=_Config())), 2 * x)  # once warned, kept in memory
    assert store.counts == {"read": 0, "written": 1, "not saved": 0}
    assert len(warnings) == 1 and f"stored program {path} could not be read" in warnings[0]
    assert compilation.ProgramStore(tmp_path)._read(path.name.removesuffix(".jax_exported")) is not None  # whole

    # A file that reads but does not compile for these arguments (another program's, of other shapes).
    y = np.ones((3, 2), np.float32)
    other = compilation.ProgramStore(tmp_path).key(_scaled._fn, ((y,), {}), {"config": _Config()}, None)
    (tmp_path / f"{other}.jax_exported").write_bytes(path.read_bytes())
    warnings.clear()
    store = compilation.ProgramStore(tmp_path, warnings.append)
    monkeypatch.setattr(compilation, "_programs", store)
    np.testing.assert_array_equal(np.asarray(_scaled(y, config=_Config())), 2 * y)
    assert store.counts == {"read": 1, "written": 1, "not saved": 0} and "could not be compiled" in warnings[0]


def test_a_program_that_cannot_be_exported_runs_as_before_and_is_not_tried_again(tmp_path, monkeypatch):
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    warnings: list[str] = []
    store = compilation.ProgramStore(tmp_path, warnings.append)
    monkeypatch.setattr(compilation, "_programs", store)
    for _ in range(2):  # its output class is not registered with jax.export: run as the plain jit, warned of once
        result = _wrapped(x, config=_Config())
        assert isinstance(result, _Unregistered) and np.array_equal(np.asarray(result.value), x + 1)
    _wrapped(np.ones((4,), np.float32), config=_Config())
    assert store.counts == {"read": 0, "written": 0, "not saved": 2}
    assert len(warnings) == 1 and "was not saved" in warnings[0] and "_Unregistered" in warnings[0]
    assert len(list(tmp_path.glob("*.not_exported"))) == 2

    warnings.clear()
    store = compilation.ProgramStore(tmp_path, warnings.append)  # the next process does not try again
    monkeypatch.setattr(compilation, "_programs", store)
    assert np.array_equal(np.asarray(_wrapped(x, config=_Config()).value), x + 1)
    assert store.counts == {"read": 0, "written": 0, "not saved": 0} and warnings == []

    # Compiled ahead from shapes, as a training run does: the plain jit's program, which the call then finds.
    y = np.ones((5,), np.float32)
    _wrapped.compile_ahead(jax.ShapeDtypeStruct(y.shape, y.dtype), config=_Config())
    with compiled_functions() as compiled:
        assert np.array_equal(np.asarray(_wrapped(y, config=_Config()).value), y + 1)
    assert compiled == [] and store.counts == {"read": 0, "written": 0, "not saved": 1}


def test_arguments_over_several_devices_take_the_plain_jit(tmp_path):
    """Arrays laid out over two (simulated) devices: the plain jit runs, nothing is stored; arrays on the second
    device alone: a program of their own, stored by the first and read back for the second device, compiled for
    each."""
    script = textwrap.dedent(
        f"""
        import numpy as np, jax
        from jax.sharding import Mesh, NamedSharding, PartitionSpec
        from jax_transformer import compilation
        from tests.test_program_store import _Config, _scaled
        store = compilation._programs = compilation.ProgramStore({str(tmp_path)!r})
        x = np.arange(8, dtype=np.float32).reshape(4, 2)
        mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
        spread = jax.device_put(x, NamedSharding(mesh, PartitionSpec("x")))
        assert np.array_equal(np.asarray(_scaled(spread, config=_Config())), 2 * x)
        assert store.counts == {{"read": 0, "written": 0, "not saved": 0}}, store.counts
        for device in jax.devices()[:2]:
            y = _scaled(jax.device_put(x, device), config=_Config())
            assert np.array_equal(np.asarray(y), 2 * x) and y.devices() == {{device}}, y.devices()
        assert store.counts == {{"read": 1, "written": 1, "not saved": 0}}, store.counts  # the second: read
        print("ok")
        """
    )
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-c", script], env=env, cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr


def test_static_arguments_must_be_keyword_only():
    with pytest.raises(TypeError, match="static argument 'config' must be keyword-only"):
        compilation.jit_by_config(lambda x, config: x, static_argnames=("config",))


def test_use_cache_turns_the_store_on_only_when_asked_and_able(tmp_path, monkeypatch):
    try:
        assert compilation.use_cache(str(tmp_path / "a"), programs=True) == tmp_path / "a"
        assert compilation._programs is not None and compilation._programs.folder == tmp_path / "a" / "programs"
        assert compilation.use_cache(str(tmp_path / "b")) == tmp_path / "b" and compilation._programs is None
        compilation.use_cache(str(tmp_path / "a"), programs=True)
        assert compilation.use_cache("off") is None and compilation._programs is None
        monkeypatch.setattr(compilation, "_can_serialize_exports", lambda: False)  # jax.export without flatbuffers
        assert compilation.use_cache(str(tmp_path / "a"), programs=True) and compilation._programs is None
    finally:
        compilation.use_cache("off")


def test_the_source_digest_covers_every_sub_package(tmp_path):
    """A stored decoder's key holds the package's source: an edit in a sub-package (the model, the search) is
    another key, not a decoder traced from the old code."""
    (tmp_path / "decoding").mkdir()
    (tmp_path / "top.py").write_text("a = 1\n")
    (tmp_path / "decoding" / "search.py").write_text("b = 1\n")
    before = compilation._package_digest(tmp_path)
    compilation._package_digest.cache_clear()
    (tmp_path / "decoding" / "search.py").write_text("b = 2\n")
    assert compilation._package_digest(tmp_path) != before
    compilation._package_digest.cache_clear()
