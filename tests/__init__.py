"""Tests of the Flax model, its training, decoding and tooling; tests/helpers/ holds the shared helpers."""
