"""What operators see: Prometheus metrics, the one-line-per-request log, and the
running statistics behind GetServerStats."""
