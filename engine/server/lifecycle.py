"""In-flight RPC accounting and the draining flag that graceful shutdown flips."""

from __future__ import annotations

import asyncio
import contextlib


class Lifecycle:
    """Counts Generation RPCs in flight; ``draining`` refuses new ones.

    Only touched from the server's event loop, so no locks.
    """

    def __init__(self) -> None:
        self.draining = False
        self.num_in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @contextlib.contextmanager
    def track(self):
        self.num_in_flight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self.num_in_flight -= 1
            if self.num_in_flight == 0:
                self._idle.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no RPC is in flight; False when ``timeout_s`` ran out first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except asyncio.TimeoutError:
            return False
        return True
