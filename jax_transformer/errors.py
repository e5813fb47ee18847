"""The errors a user can cause, in one place: the command line (`cli.main.exit_codes`) reports each as one line
("error: ...") with its exit status, instead of a traceback. Each message names what is at fault: the
setting, or the file and line, the array and position."""

from __future__ import annotations


class ConfigError(ValueError):
    """A setting has a value the program cannot use; the message names the setting (its field or flag)."""


class DataError(ValueError):
    """The data cannot be used as given. The message names the file (or corpus) and the 1-based line at fault."""


class UsageError(ValueError):
    """Settings that do not fit together, e.g. a resume asked to change what an exact resume needs unchanged."""


class WriteError(OSError):
    """A file could not be written (a full disk, a file-size limit, a missing permission). The message names the
    file and what is left of it: nothing half-written (`files.replaced`), or how much of a stream was written."""


class CheckpointError(RuntimeError):
    """A checkpoint is missing, unreadable or does not fit what it is loaded into; the message says which."""


class PortError(ValueError):
    """The weights do not fit the model; the message lists every offending name with expected/actual shapes."""


class TokenError(ValueError):
    """Token ids or shapes the model cannot take; the message names the array, the position and the limit."""


class TrainingError(RuntimeError):
    """Training cannot go on (for example the loss became NaN); the message says at which step and why."""
