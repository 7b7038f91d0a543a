"""Engine worker processes for the ABAB harness: `python -m scripts.benchmarks.workers.<name>`."""
