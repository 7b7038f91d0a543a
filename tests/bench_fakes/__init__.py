"""Trivial worker modules for the ABAB harness's own tests (`tests/test_bench_abab.py`)."""
