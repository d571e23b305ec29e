"""Logits to tokens: penalties and bias (logits_processor), structured-output matchers
and masks (grammar), temperature / top-k / top-p / min-p and seeded noise (sampler), and
the rejection sampler that verifies drafts."""
