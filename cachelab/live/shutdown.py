"""``cachelab serve``'s uvicorn server and its shutdown: a signal stops it cleanly (exit 0), the
requests in flight drained (``--shutdown-timeout``) or aborted as vLLM's server does, each client told why."""

from __future__ import annotations

import asyncio
import time

import uvicorn

from cachelab.live.engine import LiveEngine


class Server(uvicorn.Server):
    """uvicorn that, shutting down, first aborts the engine's requests (``LiveEngine.abort_all``):
    they were left to the graceful timeout, then cancelled (a 500 and a CancelledError traceback
    for a whole answer, a stream cut without ``[DONE]``). With ``drain_s`` (vLLM's
    ``--shutdown-timeout``) it stops listening and refuses new requests, lets those in flight run
    up to that long (cut short by a second Ctrl-C), then aborts what is left. The aborts reach
    their clients at the engine's next step (uvicorn's one-second graceful timeout cut a slow
    step's streams short). From the aborts on, the shutdown has ``stop_s`` (``--stop-timeout``)
    for them and for the engine's stop (``stop_left``): one deadline, where a 10 s abort wait and
    a 30 s stop wait added up past a 30 s grace period's SIGKILL. A stop asked for by a signal exits 0."""

    def __init__(self, config: uvicorn.Config, engine: LiveEngine, drain_s: float = 0.0, stop_s: float = 20.0):
        super().__init__(config)
        self.engine, self.drain_s, self.stop_s = engine, drain_s, stop_s
        self._stop_deadline: float | None = None

    def stop_left(self) -> float:
        """Seconds left of the stop budget for the engine's ``stop`` (all of it if the aborts have not begun)."""
        if self._stop_deadline is None:
            return self.stop_s
        return max(0.0, self._stop_deadline - time.monotonic())

    def handle_exit(self, sig, frame) -> None:
        super().handle_exit(sig, frame)
        # uvicorn >= 0.29 re-raises a captured signal once shut down: the process died by SIGTERM, not 0
        getattr(self, "_captured_signals", []).clear()

    async def shutdown(self, sockets=None) -> None:
        if self.drain_s > 0:
            for server in self.servers:
                server.close()
            self.engine.refuse_new()
            await self._until_idle(self.drain_s)
        self._stop_deadline = time.monotonic() + self.stop_s
        self.engine.abort_all()
        await self._until_idle(self.stop_s)
        await super().shutdown(sockets)

    async def _until_idle(self, seconds: float) -> None:
        """Wait until the engine holds no request, ``seconds`` at most (a second Ctrl-C ends it)."""
        deadline = time.monotonic() + seconds
        while self.engine.num_live and time.monotonic() < deadline and not self.force_exit:
            await asyncio.sleep(0.05)
