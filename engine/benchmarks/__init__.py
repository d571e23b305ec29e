"""Benchmark commands, `specserve bench offline | step | acceptance | blocks | serve`: each
prints ratios against a baseline run in the same invocation."""
