"""Benchmarks: scripts that print tables and keep their last results in RESULTS.md."""
