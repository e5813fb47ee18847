"""Checkpoints: orbax steps written whole and checksummed, the last K and the best (`manager`), the settings a run
stored and the older formats read (`settings`), averaging a run's last steps (`averaging`), and the tracebacks orbax
leaves after a failed read or write, quieted (`hooks`). It knows neither the training loop nor the optimiser.

May import: errors, files, checks, settings, model, data.
"""
