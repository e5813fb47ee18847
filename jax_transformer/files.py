"""Files written whole or not at all. A writer fills a temporary file beside the target, which is renamed onto it
when complete (`os.replace`, atomic on one file system) and removed when writing fails: a reader never sees half a
file, a full disk leaves nothing behind, a file already there is unchanged until the new one is whole, and the
error names the file (`WriteError`). Python's and safetensors' own writers do none of this."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

from jax_transformer.errors import WriteError


def _umask() -> int:
    """The process's umask, read without changing it (os.umask would, for a moment, for every thread)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            return next(int(line.split()[1], 8) for line in status if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError, IndexError):
        mask = os.umask(0o022)
        os.umask(mask)
        return mask


_UMASK = _umask()
_HOST = socket.gethostname()
NEW_FILE_MODE = 0o666 & ~_UMASK  # what open() gives a new file; some writers make theirs private (0600)


@contextlib.contextmanager
def replaced(path: str | os.PathLike, errors: tuple[type[BaseException], ...] = ()) -> Iterator[Path]:
    """The temporary path the block writes `path` into; renamed onto `path` when the block ends. A failure while
    writing (an OSError, or one of `errors`: a library's own error for one) is a WriteError naming `path`, and the
    temporary file is removed."""
    path = Path(path)
    temporary = _temporary(path)
    try:
        yield temporary
        os.chmod(temporary, NEW_FILE_MODE)
        os.replace(temporary, path)
    except (OSError, *errors) as e:
        raise _failed(path, e) from None
    finally:
        with contextlib.suppress(OSError):
            temporary.unlink(missing_ok=True)


@contextlib.contextmanager
def replaced_folder(path: str | os.PathLike, errors: tuple[type[BaseException], ...] = ()) -> Iterator[Path]:
    """`replaced` for a folder: the block fills a temporary folder beside `path` (which must not exist, or be
    empty), renamed onto `path` when the block ends, removed with everything in it when writing fails."""
    path = Path(path)
    temporary = _temporary(path)
    try:
        temporary.mkdir(parents=True)
        yield temporary
        os.chmod(temporary, 0o777 & ~_UMASK)
        os.replace(temporary, path)
    except (OSError, *errors) as e:
        raise _failed(path, e) from None
    finally:
        shutil.rmtree(temporary, ignore_errors=True)


def _temporary(path: Path) -> Path:
    """A name beside `path` that no other process or thread writing it uses, on any machine of a shared disk."""
    return path.with_name(f".{path.name}.{_HOST}.{os.getpid()}.{threading.get_ident()}.partial")


def _failed(path: Path, error: BaseException) -> WriteError:
    reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
    return WriteError(f"cannot write {path}: {reason} (nothing of it was written)")


def write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """`data` into `path`, whole or not at all (`replaced`)."""
    with replaced(path) as temporary:
        temporary.write_bytes(data)
    return Path(path)


def write_text(path: str | os.PathLike, text: str) -> Path:
    """`text` as UTF-8 into `path`, whole or not at all (`replaced`)."""
    return write_bytes(path, text.encode("utf-8"))


def save_figure(fig, path: str | os.PathLike, dpi: int) -> None:
    """`fig` as an image file of the type its suffix names (PNG without one), whole or not at all; then closed."""
    try:
        with replaced(path) as temporary:
            fig.savefig(temporary, dpi=dpi, format=Path(path).suffix[1:].lower() or "png")
    finally:
        import matplotlib.pyplot as plt  # (the figure's own module: matplotlib is loaded already)

        plt.close(fig)
