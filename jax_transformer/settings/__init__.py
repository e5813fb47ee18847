"""Every setting: the dataclasses with their fields' help, ranges and choices (`config`), the presets and recipes
(`configs/`), and the one resolution of a command's settings from its flags, a run's stored choice, an imported
model's defaults, a recipe and the defaults (`resolve`). Plain Python: no jax, no torch.

May import: errors, files.
"""
