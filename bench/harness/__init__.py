"""Processes and fakes the benchmarks drive (not the product): imported as `bench.harness.<module>`."""
