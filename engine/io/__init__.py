"""Requests in, tokens out: SamplingParams, prompt validation and encoding (text, chat,
token ids), incremental detokenization with stop strings, and RequestOutput."""
