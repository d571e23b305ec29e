"""Speculative decoding: proposers (draft model, n-gram lookup) and the rejection sampler."""
