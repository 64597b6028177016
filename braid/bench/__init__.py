"""Benchmark tooling: datasets and load generation."""
