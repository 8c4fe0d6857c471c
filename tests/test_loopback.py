"""The scripted OpenAI-style server of the bench tests (``loopback.CompletionsServer``) leaves
nothing running when its ``with`` ends."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

# a server whose answer outlives its client (it gives up after 0.3 s) and a kept-alive connection; one idle
LEFT_BEHIND = """
import asyncio

import aiohttp
from aiohttp import web

from loopback import CompletionsServer


class Stalling(CompletionsServer):
    async def completions(self, request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: x")
        await asyncio.sleep(30)
        return resp


async def client(url):
    async with aiohttp.ClientSession() as session:
        try:
            async with session.post(url + "/v1/completions", json={}, timeout=aiohttp.ClientTimeout(total=0.3)) as r:
                await r.read()
        except asyncio.TimeoutError:
            pass
        async with session.get(url + "/v1/models") as r:
            assert (await r.json())["data"][0]["id"] == "scripted"


server = Stalling()
with server as url:
    asyncio.run(client(url))
assert server.loop.is_closed() and not server.thread.is_alive()
idle = CompletionsServer()  # nothing left to cancel
with idle:
    pass
assert idle.loop.is_closed() and not idle.thread.is_alive()
"""


def test_the_server_ends_its_handlers_as_its_with_ends():
    """The exit stopped the server's loop with its handlers' tasks pending (an answer still streaming
    to a client that had gone, a kept-alive connection's): as the process ended Python logged 'Task was
    destroyed but it is pending!' for each, the noise after the bench tests' runs."""
    res = subprocess.run([sys.executable, "-c", LEFT_BEHIND], cwd=Path(__file__).parent, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "Task was destroyed" not in res.stderr, res.stderr
