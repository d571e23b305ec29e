"""Prompt -> token ids, validated against the model before a request is queued."""

from __future__ import annotations

from engine.io.sampling_params import SamplingParams


class InputProcessor:
    def __init__(
        self, tokenizer, vocab_size: int, max_model_len: int, max_spec_tokens: int
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        # The engine's num_speculative_tokens; 0 when it has no proposer.
        self.max_spec_tokens = max_spec_tokens

    def prompt_token_ids(
        self,
        prompt: str | list[int] | None,
        messages: list[dict[str, str]] | None,
        params: SamplingParams,
    ) -> list[int]:
        """The request's prompt as token ids; ValueError naming the field otherwise.
        ``messages`` (chat) go through the model's chat template. With
        ``truncate_prompt_tokens`` only its last n tokens are kept, before the length
        check."""
        prompt_ids = self._encode(prompt, messages)
        if params.truncate_prompt_tokens is not None:
            prompt_ids = prompt_ids[-params.truncate_prompt_tokens :]
        self._validate(prompt_ids, params)
        return prompt_ids

    def _encode(
        self, prompt: str | list[int] | None, messages: list[dict[str, str]] | None
    ) -> list[int]:
        if messages is not None:
            if prompt:
                raise ValueError("give either prompt or messages, not both")
            if not messages:
                raise ValueError("messages must not be empty")
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
            return list(self.tokenizer.encode(text, add_special_tokens=False))
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            return list(self.tokenizer.encode(prompt))
        if prompt is None:
            raise ValueError("prompt must not be empty")
        return list(prompt)

    def _validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        if not prompt_ids:
            raise ValueError("prompt must not be empty (it encodes to 0 tokens)")
        for i, token_id in enumerate(prompt_ids):
            if (
                isinstance(token_id, bool)
                or not isinstance(token_id, int)
                or not (0 <= token_id < self.vocab_size)
            ):
                raise ValueError(
                    f"prompt_token_ids[{i}] = {token_id!r} is outside the vocabulary "
                    f"[0, {self.vocab_size - 1}]"
                )
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(prompt_ids)} tokens; the context window allows at most "
                f"{self.max_model_len - 1} prompt tokens (max_model_len {self.max_model_len})"
            )
        for field, token_ids in (
            ("stop_token_ids", params.stop_token_ids),
            ("logit_bias", params.logit_bias),
        ):
            for token_id in token_ids:
                if token_id >= self.vocab_size:
                    raise ValueError(
                        f"{field} contains token id {token_id}, outside the vocabulary "
                        f"[0, {self.vocab_size - 1}]"
                    )
        k = params.num_speculative_tokens
        if k and k > self.max_spec_tokens:
            if not self.max_spec_tokens:
                raise ValueError(
                    f"num_speculative_tokens must be 0 or unset: this engine does not "
                    f"speculate (speculative_method 'none'), got {k}"
                )
            raise ValueError(
                f"num_speculative_tokens must be in [0, {self.max_spec_tokens}] (the "
                f"engine's num_speculative_tokens), got {k}"
            )
