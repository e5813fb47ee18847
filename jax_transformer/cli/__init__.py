"""The command line: one module per sub-command (each `add(sub)` declares its flags, `run(args)` does it), the flags
built from the settings' fields (`flags`), and `main`, which parses, dispatches and maps errors to exit codes. Run
as `python train.py ...` or the console script `jax-transformer ...`.

May import: anything of the package.
"""
