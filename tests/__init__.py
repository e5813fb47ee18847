"""Tests of the Flax model, its training, decoding and tooling; tests/fixtures.py holds the shared helpers."""
