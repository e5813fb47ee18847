"""Benchmarks of the Flax Transformer against its PyTorch reference: `python benchmarks/run.py --help`."""
