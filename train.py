#!/usr/bin/env python3
"""Train, evaluate and use the Transformer from the command line: `jax_transformer.cli.main`, as the console script
`jax-transformer` runs it.

    python train.py                                   # train on the built-in English->French numbers task
    python train.py train --src train.de --tgt train.en --valid-src val.de --valid-tgt val.en --preset small
    python train.py translate --checkpoint runs/my-run < input.de > output.en
    python train.py SUBCOMMAND --help                 # every flag of a sub-command

Each sub-command is a module of `jax_transformer/cli/`; the exit statuses are in `jax_transformer/cli/main.py`.
"""

import sys

from jax_transformer.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
