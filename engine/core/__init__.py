"""The step loop: LLMEngine.step() (schedule, propose, forward, verify, update, emit),
the AsyncEngine thread that serves it to asyncio callers, the model runner and KV sizing."""
