"""train.py serve whose decoding waits while a file exists, for tests that need requests to be in flight at a known
moment (a full queue, a SIGTERM during decoding) instead of wherever a timer happens to fall.

    python -m tests.helpers.serve_held HOLD_FILE serve --checkpoint RUN ...

While HOLD_FILE exists, each decoding call of the service's batcher waits before it starts (HOLD_FILE.inside
exists while one waits); the test creates the file, sends its requests, reads /health until they are where it
wants them, then removes the file. Nothing here
changes what is decoded.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path


def main() -> int:
    hold = Path(sys.argv[1])
    from jax_transformer.decoding import translation

    original = translation.translations

    def held(*args, **kwargs):
        inside = hold.with_name(hold.name + ".inside")  # tells the test that a decoding waits here
        if hold.exists():
            inside.touch()
        while hold.exists():
            time.sleep(0.01)
        inside.unlink(missing_ok=True)
        return original(*args, **kwargs)

    translation.translations = held
    from jax_transformer.cli import main as cli

    return cli.main(sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
