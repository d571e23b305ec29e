"""Native kernels: fp32 CPU attention, norm, rotary and activation (``cpu``)."""
