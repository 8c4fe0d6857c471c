"""A free TCP port on 127.0.0.1, for tests and benchmarks that start a server of their own, and
a scripted OpenAI-style server on it."""

from __future__ import annotations

import asyncio
import socket
import threading


def free_port() -> int:
    """A port the kernel just handed out on loopback (closed again, so a server can bind it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class CompletionsServer:
    """An OpenAI-style server a test scripts: ``/v1/models`` lists ``model``, ``/v1/completions``
    is the subclass' ``completions`` handler; served from a thread and event loop of its own
    (the client under test runs its own loop); ``with`` gives its URL."""

    model = "scripted"

    def __init__(self):
        self.port, self.loop = free_port(), asyncio.new_event_loop()
        self.thread, self.ready = threading.Thread(target=self._serve, daemon=True), threading.Event()

    async def completions(self, request):
        raise NotImplementedError

    def _serve(self):
        from aiohttp import web

        async def models(request):
            return web.json_response({"data": [{"id": self.model}]})

        app = web.Application(client_max_size=1 << 30)  # aiohttp's 1 MiB refuses a prompt of 130k ids
        app.router.add_get("/v1/models", models)
        app.router.add_post("/v1/completions", self.completions)
        runner = web.AppRunner(app, shutdown_timeout=0.1)  # a request still in hand at the exit gets 0.1 s
        self.loop.run_until_complete(runner.setup())
        self.loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", self.port).start())
        self.ready.set()
        self.loop.run_forever()
        # stopped (the exit): the site and connections closed, then every task still pending cancelled (a
        # handler streaming to a client that has gone is no connection's any more) before the loop goes;
        # left pending, each was 'Task was destroyed but it is pending!' at the test process's exit
        self.loop.run_until_complete(runner.cleanup())
        left = asyncio.all_tasks(self.loop)
        for task in left:
            task.cancel()
        if left:  # gather of nothing looks for this thread's loop, which it has none of
            self.loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
        self.loop.close()

    def __enter__(self):
        self.thread.start()
        self.ready.wait(10)
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
