"""Native CPU kernels, compiled at first use: paged attention, Linear layers, norms,
rotary, activations and the one-call decoder, in fp32 and bf16."""
