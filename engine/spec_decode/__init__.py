"""Speculative decoding: proposers (n-gram lookup, draft model, trained drafts, hybrid)
and the verifier that checks their drafts (engine/sample/ holds the rejection sampler)."""
