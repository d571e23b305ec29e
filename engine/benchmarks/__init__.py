"""Benchmark commands: `specserve bench offline | blocks | serve`."""
