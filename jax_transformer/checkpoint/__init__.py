"""Checkpoints: orbax steps written whole and checksummed, the last K and the best (`manager`), the settings a run
stored and the older formats read (`settings`), and averaging a run's last steps (`averaging`). It knows neither
the training loop nor the optimiser.

May import: errors, files, checks, settings, model, data.
"""
