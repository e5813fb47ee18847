"""Many devices and many processes: joining the processes (`jax.distributed`), agreeing across them, and where
the state and each batch live for the three ways to run a step (`DataParallel`): "jit" (one device), "pmap" (this
process's devices, a block of rows each) and "sharded" (a one-axis mesh of every device of every process, the
batch one global array split by rows). All three compute the same update. Process 0 alone writes and prints; the
reasons to stop are agreed at each step; a process that dies makes the others end with a message (`PeerWatch`)."""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
import time
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import jax
import numpy as np

from jax_transformer.errors import ConfigError, DataError
from jax_transformer.model.sharding import BATCH_AXES, MeshShape, spec_for, tree_shardings
from jax_transformer.settings.config import OptimConfig, ParallelConfig, TransformerConfig, host_port
from jax_transformer.training.trainer import make_train_step, replicate, shard_batch, unreplicate

T = TypeVar("T")

# =============================================================================================================
# Joining the processes
# =============================================================================================================


def initialize(parallel: ParallelConfig, print_fn: Callable[[str], None] = print) -> None:
    """Joins this process to the others (`jax.distributed.initialize`) when `parallel` says it is one of several;
    does nothing otherwise, or when already done. Must run before anything starts JAX's backends."""
    if not parallel.multi_process or jax.distributed.is_initialized():
        return
    timeouts = parallel.timeouts()
    # On CPU the cross-process collectives need an implementation; gloo ships with jaxlib. GPUs and TPUs use
    # their own (NCCL, ICI), so the setting changes nothing there.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if parallel.coordinator is not None and parallel.process_id is not None:
        probe_coordinator(parallel.coordinator, parallel.process_id, timeouts["init"])
    kwargs = dict(
        initialization_timeout=timeouts["init"],
        heartbeat_timeout_seconds=timeouts["heartbeat"],
        # How long a finishing process waits at exit for the others to finish too.
        shutdown_timeout_seconds=timeouts["heartbeat"],
    )
    if not parallel.distributed:
        kwargs.update(
            coordinator_address=parallel.coordinator,
            num_processes=parallel.num_processes,
            process_id=parallel.process_id,
        )
    else:  # --distributed: what was given is passed on, the rest jax detects
        kwargs.update(
            {
                k: v
                for k, v in (
                    ("coordinator_address", parallel.coordinator),
                    ("num_processes", parallel.num_processes),
                    ("process_id", parallel.process_id),
                )
                if v is not None
            }
        )
    try:
        jax.distributed.initialize(**kwargs)
    except (ValueError, RuntimeError) as e:  # e.g. --distributed on a machine where nothing can be detected
        hint = (
            "; --distributed relies on the cluster's environment (a TPU pod, Slurm, Open MPI): elsewhere give "
            "--coordinator HOST:PORT --num-processes N --process-id I"
            if parallel.distributed
            else ""
        )
        raise ConfigError(f"jax.distributed.initialize failed: {e}{hint}") from None
    global _WATCH
    if parallel.coordinator is not None:  # (with --distributed alone the address of process 0 is not known here)
        _WATCH = PeerWatch.join(parallel.coordinator, jax.process_index(), jax.process_count(), timeouts["init"])
    print_fn(
        f"process {jax.process_index()} of {jax.process_count()}: {jax.local_device_count()} local device(s), "
        f"{jax.device_count()} in all (timeouts: join {timeouts['init']} s, heartbeat {timeouts['heartbeat']} s)"
        + ("" if jax.process_index() == 0 else "; process 0 reports the run")
    )


def probe_coordinator(address: str, process_id: int, timeout: float) -> None:
    """Before `jax.distributed.initialize`, whose failures abort the process without a Python error: process 0
    checks that it can listen on the port; the others that something answers there within `timeout` seconds
    (process 0 may start later than they do)."""
    host, port = host_port(address)
    if process_id == 0:
        try:
            with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind(("::" if ":" in host else "", port))
        except OSError as e:
            raise ConfigError(
                f"--coordinator {address}: process 0 runs the coordinator there but cannot listen on port {port} "
                f"({e.strerror or e}); choose a free port and give it to every process"
            ) from None
        return
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(2.0, deadline - time.monotonic()))):
                return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise ConfigError(
                    f"--coordinator {address}: nothing answers there after {timeout:g} s ({e.strerror or e}). "
                    f"Start process 0 with the same --coordinator on the machine {host} names, check that the port "
                    f"is open between the machines, or raise --init-timeout"
                ) from None
            time.sleep(0.2)


# =============================================================================================================
# When a process dies: the others end with a message, not an abort
# =============================================================================================================

# The exit status of a process that stops because another process of its run stopped answering.
EXIT_PEER_LOST = 5
# After a peer announces that it is ending with an error, how long this process may take to end on its own (the
# same error reached at the same step: every process raises it) before it is stopped as left alone.
ERROR_GRACE_SECONDS = 5.0


class PeerWatch:
    """Every process of a multi-process run holds one TCP connection to process 0, opened when the processes join.
    When a process dies (kill -9, a crash), its operating system closes the connection at once; the process at
    the other end then prints which process stopped answering, the newest complete checkpoint and the command that
    resumes the run, and ends with EXIT_PEER_LOST, from a background thread, because its main thread is typically
    blocked in a collective that will never complete. Process 0 tells the other survivors which process it lost.

    Written by hand because JAX offers no hook: its coordination service aborts the survivors (SIGABRT, a fatal C++
    log line) once the dead process misses its heartbeats, and `jax.distributed.initialize` takes no callback.
    A process that ends as the run ends (any stop the processes agreed on) says so first ("end ok"), and one that
    ends with an error says that ("end error: ..."); neither is taken for a death. A machine that vanishes without
    closing its connections is still caught by JAX's heartbeats."""

    def __init__(self, connections: dict[int, tuple[socket.socket, Any]], me: int, count: int) -> None:
        """`connections`: {peer: (socket, its line reader)}."""
        self.connections = {peer: connection for peer, (connection, _) in connections.items()}
        self.me, self.count = me, count
        self.run_dir: str | None = None
        self.resume_hint = ""
        self._ended = threading.Event()  # this process is ending on its own: report nothing
        self._lock = threading.Lock()
        for peer, (_, reader) in connections.items():
            threading.Thread(target=self._listen, args=(peer, reader), name=f"peer-{peer}", daemon=True).start()

    @classmethod
    def join(cls, address: str, me: int, count: int, timeout: float) -> PeerWatch:
        """Process 0 listens on a free port, every process learns it (a collective), the others connect."""
        host, _ = host_port(address)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener, port = None, 0
        if me == 0:
            listener = socket.socket(family)
            listener.bind(("::" if family == socket.AF_INET6 else "", 0))
            listener.listen(count)
            port = listener.getsockname()[1]
        port = int(_gather_words(np.array([port], np.uint32))[0, 0])
        connections = {}
        if me == 0:
            listener.settimeout(timeout)
            for _ in range(count - 1):
                connection, _ = listener.accept()
                connection.settimeout(None)
                reader = connection.makefile("r", encoding="utf-8", errors="replace")
                connections[int(reader.readline())] = (connection, reader)
            listener.close()
        else:
            connection = socket.create_connection((host, port), timeout=timeout)
            connection.settimeout(None)
            connection.sendall(f"{me}\n".encode())
            connections[0] = (connection, connection.makefile("r", encoding="utf-8", errors="replace"))
        return cls(connections, me, count)

    def _listen(self, peer: int, reader) -> None:
        for line in reader:
            word, _, rest = line.strip().partition(" ")
            if word == "lost":  # process 0 lost another process and is about to end
                self._lost(int(rest), f"process {rest} stopped answering")
                return
            if word == "end":
                if rest.startswith("error"):  # let this process end on the same error by itself first
                    if not self._ended.wait(ERROR_GRACE_SECONDS):
                        self._lost(peer, f"process {peer} ended with an {rest}")
                return
        self._lost(
            peer,
            f"process {peer} stopped answering (its connection closed without the run ending: it was "
            f"killed or crashed)",
        )

    def _lost(self, peer: int, what: str) -> None:
        if self._ended.is_set():
            return
        with self._lock:
            for other, connection in self.connections.items():
                if other != peer:
                    with contextlib.suppress(OSError):
                        connection.sendall(f"lost {peer}\n".encode())
            print(
                f"error: {what}; process {self.me} of {self.count} stops too. {self._where_to_resume()}",
                file=sys.stderr,
                flush=True,
            )
            sys.stdout.flush()
            os._exit(EXIT_PEER_LOST)

    def _where_to_resume(self) -> str:
        if self.run_dir is None:
            return "The run had not started training."
        from jax_transformer.checkpoint.manager import CHECKPOINT_SUBDIR, committed_steps

        steps = committed_steps(Path(self.run_dir) / CHECKPOINT_SUBDIR)
        saved = f"the newest complete checkpoint is step {steps[-1]}" if steps else "no checkpoint was saved yet"
        return f"In {self.run_dir} {saved}; resume the run with {self.resume_hint}"

    def end(self, error: str | None = None) -> None:
        """This process ends on its own: the run ended (error None) or an error stops it; the peers are told."""
        self._ended.set()
        message = "end ok\n" if error is None else f"end error: {' '.join(error.split())[:300]}\n"
        for connection in self.connections.values():
            with contextlib.suppress(OSError):
                connection.sendall(message.encode())


_WATCH: PeerWatch | None = None


def watch_run(run_dir: str | os.PathLike, resume_hint: str) -> None:
    """What a survivor's message names: the run directory (its newest checkpoint) and the command that resumes."""
    if _WATCH is not None:
        _WATCH.run_dir, _WATCH.resume_hint = str(run_dir), resume_hint


def end_run(error: str | None = None) -> None:
    """Tells the other processes that this one ends on its own (see `PeerWatch.end`); a no-op in one process."""
    if _WATCH is not None:
        _WATCH.end(error)


# =============================================================================================================
# Who writes, and agreeing across processes
# =============================================================================================================


def process_index() -> int:
    return jax.process_index()


def process_count() -> int:
    return jax.process_count()


def is_primary() -> bool:
    """True in process 0 (and in a single-process run): the one process that writes metrics, plots, the progress
    bar, tokenizer.model and config.json, prints, and holds any lock on the run directory."""
    return jax.process_index() == 0


def barrier(name: str) -> None:
    """Every process waits here until all have arrived (a no-op in a single-process run)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def _gather_words(words: np.ndarray) -> np.ndarray:
    """(n,) uint32 from every process -> (processes, n), the same on all of them."""
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(np.asarray(words, np.uint32))).reshape(jax.process_count(), -1)


def all_same(what: str, value: bytes) -> None:
    """ConfigError in every process unless all processes hold the same `value` (e.g. their settings): each must
    be started with the same flags and see the same files. A no-op in a single-process run."""
    if jax.process_count() == 1:
        return
    hashes = _gather_words(np.array([zlib.crc32(value)], np.uint32))[:, 0]
    differ = [i for i, h in enumerate(hashes) if h != hashes[0]]
    if differ:
        raise ConfigError(
            f"process(es) {differ} have other {what} than process 0; every process must be started with the same "
            f"flags (except --process-id) and see the same data files"
        )


_REASON_BYTES = 32  # a stop reason travels as this many bytes of UTF-8
_ERROR_BYTES = 1024  # and process 0's error, in `primary_first`


def primary_first(what: str, work: Callable[[], T]) -> T | None:
    """`work()` in process 0 alone (what it writes, the others then read), then one collective that every process
    passes: an error in process 0 ends every process, the others with a DataError naming it, instead of leaving
    them waiting at a barrier. work's result in process 0; None in the others (and in every process, after it)."""
    if jax.process_count() == 1:
        return work()
    result, error = None, None
    if is_primary():
        try:
            result = work()
        except Exception as e:  # noqa: BLE001 (raised again below, after the others are told)
            error = e
    failed = _first_text(None if error is None else f"{type(error).__name__}: {error}", _ERROR_BYTES)
    if error is not None:
        raise error
    if failed is not None:
        raise DataError(f"process 0 stopped while {what}: {failed}")
    return result


def agree_on_stop(reason: str | None) -> str | None:
    """The one stop decision of all processes at a step boundary, from each process's own reason (None: go on).

    Process 0's reason wins; when it has none, the first other process's (a signal sent to that process alone,
    a save that failed there). Every process gathers all reasons and applies this rule, so all leave the loop at
    the same step with the same reason. One small collective per step, in multi-process runs only; a
    single-process run returns its own reason as it is."""
    return _first_text(reason, _REASON_BYTES)


def _first_text(text: str | None, size: int) -> str | None:
    """Every process's `text` (its first `size` bytes of UTF-8) gathered; the first that is not None, by process."""
    if jax.process_count() == 1:
        return text
    encoded = np.zeros(size, np.uint8)
    if text is not None:
        raw = text.encode("utf-8", "replace")[:size] or b" "
        encoded[: len(raw)] = np.frombuffer(raw, np.uint8)
    for row in _gather_words(encoded.view(np.uint32)):
        said = row.astype(np.uint32).view(np.uint8).tobytes().rstrip(b"\0").decode("utf-8", "replace")
        if said:
            return said
    return None


# =============================================================================================================
# Where state and batches live
# =============================================================================================================


class DataParallel:
    """The devices of a run and how a step uses them (see the module docstring): `place_state`, `place_batch`,
    `local` (one device's copy of a replicated tree, for evaluation and saving) and `make_step`."""

    def __init__(self, parallel: str = "auto", accumulate: int = 1, mesh: str | None = None) -> None:
        if parallel == "auto":
            parallel = "sharded" if jax.device_count() > 1 or mesh else "jit"
        if parallel in ("jit", "pmap") and jax.process_count() > 1:
            raise ConfigError(f"--parallel {parallel} runs in one process; this run has {jax.process_count()}")
        if mesh and parallel != "sharded":
            raise ConfigError(f"--mesh {mesh} is for --parallel sharded (or auto), not --parallel {parallel}")
        self.mode, self.accumulate = parallel, accumulate
        self.n_devices = {"jit": 1, "pmap": jax.local_device_count(), "sharded": jax.device_count()}[parallel]
        self.mesh_shape = MeshShape.parse(mesh, self.n_devices) if parallel == "sharded" else None
        if parallel == "sharded":
            from jax.sharding import NamedSharding
            from jax.sharding import PartitionSpec as P

            self.mesh = self.mesh_shape.mesh()
            self.replicated = NamedSharding(self.mesh, P())
            self.by_rows = NamedSharding(self.mesh, P(BATCH_AXES))

    @classmethod
    def from_config(cls, parallel: ParallelConfig) -> DataParallel:
        return cls(parallel.parallel, parallel.accumulate, parallel.mesh)

    def describe(self) -> str:
        where = f"{self.n_devices} device(s)"
        if jax.process_count() > 1:
            where += f" in {jax.process_count()} processes"
        if self.mesh_shape is not None and self.mesh_shape.shards_state:
            where += f", mesh {self.mesh_shape}"
        text = f"{self.mode} on {where} ({jax.devices()[0].platform})"
        return text + (f", {self.accumulate} micro-batches per step" if self.accumulate > 1 else "")

    # --- batches -------------------------------------------------------------------------------------------
    @property
    def batch_devices(self) -> int:
        """The devices a batch's rows are split over (a mesh's tensor devices share their rows)."""
        return self.n_devices if self.mesh_shape is None else self.mesh_shape.batch_devices

    @property
    def row_divisor(self) -> int:
        """A batch's rows must be a multiple of this: devices holding rows x micro-batches."""
        return self.batch_devices * self.accumulate

    def check_rows(self, rows: int, where: str = "a batch") -> None:
        """ConfigError unless `rows` split evenly over the devices and micro-batches."""
        if rows % self.row_divisor:
            split = self.mesh_shape is not None and self.mesh_shape.shards_state
            over = f"{self.batch_devices} device(s)" + (f" (data x fsdp of --mesh {self.mesh_shape})" if split else "")
            raise ConfigError(
                f"{where} has {rows} rows, which do not split evenly over {over} x "
                f"{self.accumulate} micro-batch(es) (--accumulate): rows must be a multiple of {self.row_divisor}. "
                f"Set --row-multiple to a multiple of {self.row_divisor} (bucketed batches) or choose --max-tokens "
                f"so that every batch's rows divide"
            )

    def place_batch(self, batch: Mapping[str, np.ndarray], rows: int | None = None):
        """The global batch (numpy, (B, L) arrays) placed for the step: as it is (jit), one block of rows per
        local device (pmap), or a global array of which this process supplies only its own rows (sharded). With
        `rows` (sharded), `batch` holds only this process's rows (`process_rows`) of a global batch of `rows`."""
        local = rows is not None
        rows = rows if local else len(batch["tgt_out"])
        self.check_rows(rows)
        if self.mode == "jit":
            return batch
        if self.mode == "pmap":
            return shard_batch(batch, self.n_devices)
        mine = slice(None) if local else self.process_rows(rows)
        return {
            key: jax.make_array_from_process_local_data(
                self.by_rows, np.asarray(value)[mine], (rows, *np.shape(value)[1:])
            )
            for key, value in batch.items()
        }

    def process_rows(self, rows: int) -> np.ndarray:
        """Indices of the global batch rows this process's devices hold, in the order
        `make_array_from_process_local_data` expects them (increasing)."""
        blocks = self.by_rows.addressable_devices_indices_map((rows,)).values()
        starts = sorted({index[0].start or 0 for index in blocks})
        per_device = rows // self.batch_devices
        return np.concatenate([np.arange(start, start + per_device) for start in starts])

    # --- the state -----------------------------------------------------------------------------------------
    def place_state(self, state):
        """A TrainState (host or one-device arrays) as the step wants it: replicated on every device, or laid out
        over the mesh by `sharding.RULES` (each process supplies the shards of its own devices)."""
        if self.mode == "jit":
            return state
        if self.mode == "pmap":
            return replicate(state, self.n_devices)
        shardings = tree_shardings(state, self.mesh, self.mesh_shape)
        return jax.tree_util.tree_map(_placed, state, shardings)

    def global_view(self, tree):
        """A tree of the step's as global arrays, each where it lies (what a checkpoint writes, shard by shard):
        pmap's stacked replicas as one copy; jit's and sharded jit's arrays as they are."""
        return unreplicate(tree, self.n_devices) if self.mode == "pmap" else tree

    def placement(self, name: str, shape: tuple[int, ...]):
        """Where the sharded step wants the state's array `name` (checkpoint.Placement): a restore reads each array
        straight onto the mesh, each process only its own shards."""
        from jax.sharding import NamedSharding

        return NamedSharding(self.mesh, spec_for(name, shape, self.mesh_shape))

    def local(self, tree):
        """A tree of the step's (the state, a step's loss sums) whole on this process: what evaluation and saving
        read. Replicated, each process reads its own first device, no communication; split over fsdp / tensor,
        the shards are gathered (every process then holds the whole state: docs/scaling.md)."""
        if self.mode == "jit":
            return tree
        if self.mode == "pmap":
            return unreplicate(tree, self.n_devices)
        return jax.tree_util.tree_map(_whole, tree)

    # --- the step ------------------------------------------------------------------------------------------
    def make_step(self, config: TransformerConfig, optim: OptimConfig, *, dropout: bool = True):
        return make_train_step(
            config,
            optim,
            n_devices=self.n_devices,
            parallel=self.mode,
            accumulate=self.accumulate,
            dropout=dropout,
            mesh=self.mesh_shape,
        )


def _placed(leaf, sharding):
    """A host or one-device array as a global array of `sharding`, from this process's copy of the whole."""
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):  # a typed key: its words, then wrapped again
        return jax.random.wrap_key_data(_placed(jax.random.key_data(leaf), sharding))
    if isinstance(leaf, jax.Array) and leaf.sharding.is_equivalent_to(sharding, leaf.ndim):
        return leaf  # restored onto the mesh already
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:  # on another mesh: the compiler moves it
        return jax.device_put(leaf, sharding)
    host = np.asarray(leaf)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def _whole(leaf):
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        return jax.random.wrap_key_data(_whole(jax.random.key_data(leaf)))
    if leaf.sharding.is_fully_replicated:
        return leaf.addressable_data(0)
    if leaf.is_fully_addressable:  # one process: gathered onto its first device
        return jax.device_put(leaf, jax.local_devices()[0])
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(leaf, tiled=True)
