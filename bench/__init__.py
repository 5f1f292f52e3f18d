"""The benchmarks (docs/benchmarks.md): each is run as `python -m bench.<name>` from the repository root."""
