"""What a whole (non-SSE, ``stream: false``) answer costs the capture, against a reference measured in
the same run.

``tokenize``: the record of a whole answer of text without ids (an upstream without vLLM's
``return_token_ids``: SGLang, a hosted API) built by the writer (``Exchange.to_records`` with the fallback
tokenizer), against one tokenization of the answer's text by the same tokenizer. The text was
tokenized twice (once for the output ids, once more for the answer's one token count): the ratio was
about 2, it is now about 1. The text is the repository's docs, so the tokenizer sees prose.

``relay``: the time to the first byte (TTFB) and to the last (TTLB) of a whole answer with a long prompt's
ids, direct and through `cachelab capture proxy`, in alternating requests. The upstream (its own process, a
raw asyncio server answering at once, as vLLM's JSONResponse writes a whole body in one go after the
generation) sends ``prompt_token_ids`` and ``token_ids`` where asked (the proxy asks), ``null`` otherwise, so
the client's bytes are the same on both paths. The proxy holds a whole answer until it is complete: its
length is known only once the ids it asked for are taken out (docs/capture.md, "Bounds and security").
With ``--client-ids`` the client asks for the ids itself: nothing is taken out, and the proxy relays the
answer as it comes (a copy kept for the record).

Run: .venv/bin/python benchmarks/bench_capture_whole.py tokenize [--chars 262144 --repeats 3]
     .venv/bin/python benchmarks/bench_capture_whole.py relay [--prompt-ids 1000000 --text-chars 4096 --requests 20]
                                                              [--client-ids]
"""

from __future__ import annotations

import cli_numpy  # noqa: F401  (first, before NumPy: NumPy as the command line runs it)

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import timeit
from multiprocessing import Process
from pathlib import Path

import numpy as np

from bench_capture import wait_up

ROOT = Path(__file__).resolve().parents[1]


def prose(chars: int) -> str:
    """``chars`` characters of the repository's docs, repeated as needed."""
    text = "\n".join(p.read_text(encoding="utf-8") for p in sorted((ROOT / "docs").glob("*.md")))
    return (text * (chars // len(text) + 1))[:chars]


def tokenize(args) -> None:
    from cachelab.capture.exchange import Exchange
    from cachelab.capture.tokens import FallbackTokenizer

    text = prose(args.chars)
    tok = FallbackTokenizer(max_chars=2 * args.chars)
    tok.encode("warm up")  # loaded before anything is timed
    x = Exchange(endpoint="/v1/completions", arrival_unix_ns=0, arrival=0.0, status=200, response_time=1.0,
                 body={"model": "m", "prompt": "the row cache"},
                 response=json.dumps({"id": "c", "choices": [{"index": 0, "text": text}]}).encode())
    [rec] = x.to_records(tok)
    assert rec.token_source == "tokenizer" and rec.output_ids.tolist() == tok.encode(text)
    once = min(timeit.repeat(lambda: tok.encode(text), number=1, repeat=args.repeats))
    record = min(timeit.repeat(lambda: x.to_records(tok), number=1, repeat=args.repeats))
    print(f"load {os.getloadavg()[0]:.2f}; a whole answer of {len(text):,} characters, {len(rec.output_ids):,} tokens "
          f"(best of {args.repeats})")
    print(f"  one tokenization of its text  {once * 1e3:8.1f} ms")
    print(f"  its record (to_records)       {record * 1e3:8.1f} ms   = {record / once:.2f} tokenizations")


def serve_whole(port: int, prompt_ids: int, text_chars: int) -> None:
    """A raw upstream: every POST gets the same whole completion, its ids where the request asked for them."""
    text = "x" * text_chars
    ids = list(range(prompt_ids))
    bodies = {want: json.dumps({"id": "cmpl-w", "object": "text_completion", "created": 1, "model": "m", "choices": [
        {"index": 0, "text": text, "finish_reason": "length", "token_ids": [7] * 16 if want else None}],
        "usage": {"prompt_tokens": prompt_ids, "completion_tokens": 16}, "prompt_token_ids": ids if want else None},
        separators=(",", ":")).encode() for want in (False, True)}
    answers = {want: b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
               % (len(body), body) for want, body in bodies.items()}

    class Server(asyncio.Protocol):
        def connection_made(self, transport):
            self.transport, self.got = transport, b""

        def data_received(self, data):
            self.got += data
            head, sep, body = self.got.partition(b"\r\n\r\n")
            length = int(next((line.split(b":")[1] for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length")), b"0"))
            if sep and len(body) >= length:
                self.got = body[length:]
                self.transport.write(answers[b'"return_token_ids":true' in body[:length]])

    loop = asyncio.new_event_loop()
    loop.run_until_complete(loop.create_server(Server, "127.0.0.1", port))
    loop.run_forever()


def timed_request(port: int, client_ids: bool) -> tuple[float, float, bytes]:
    """One request on a new connection (asking for the ids itself with ``client_ids``): seconds to the
    answer's first byte, to its last, and its body."""
    body = b'{"model":"m","prompt":"the row cache","max_tokens":16%s}' % (b',"return_token_ids":true' * client_ids)
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        start = time.perf_counter()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%s" % (len(body), body))
        got = sock.recv(1 << 20)
        first = time.perf_counter()
        while b"\r\n\r\n" not in got:
            got += sock.recv(1 << 20)
        head, _, body = got.partition(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length")))
        while len(body) < length:
            body += sock.recv(1 << 20)
        last = time.perf_counter()
    return first - start, last - start, body


def relay(args) -> None:
    from loopback import free_port

    up_port, proxy_port = free_port(), free_port()
    server = Process(target=serve_whole, args=(up_port, args.prompt_ids, args.text_chars), daemon=True)
    server.start()
    out = tempfile.mkdtemp()
    proxy = subprocess.Popen([sys.executable, "-m", "cachelab", "capture", "proxy", "--upstream",
                              f"http://127.0.0.1:{up_port}", "--out", f"{out}/cap", "--listen",
                              f"127.0.0.1:{proxy_port}"], stderr=subprocess.DEVNULL)
    try:
        wait_up(f"http://127.0.0.1:{proxy_port}/capture/status", proxy, "the proxy")
        times = {"direct": [], "proxy": []}
        for i in range(args.requests + 2):  # the first of each path untimed
            for path, port in (("direct", up_port), ("proxy", proxy_port))[::1 if i % 2 else -1]:
                first, last, body = timed_request(port, args.client_ids)
                if i >= 2:
                    times[path].append((first, last))
                else:
                    times.setdefault(path + " body", body)
        assert times["direct body"] == times["proxy body"], "the client's bytes differ through the proxy"
    finally:
        proxy.terminate()
        proxy.wait(60)
        server.terminate()
    d, p = (np.median(np.array(times[k]), axis=0) * 1e3 for k in ("direct", "proxy"))
    print(f"load {os.getloadavg()[0]:.2f}; a whole answer of {args.prompt_ids:,} prompt ids asked by the "
          f"{'client' if args.client_ids else 'proxy'} ({len(times['direct body']):,} bytes to the client), "
          f"median of {args.requests}")
    print(f"  TTFB  direct {d[0]:7.2f} ms  proxy {p[0]:7.2f} ms  (+{p[0] - d[0]:.2f} ms, {p[0] / d[0]:.1f}x)")
    print(f"  TTLB  direct {d[1]:7.2f} ms  proxy {p[1]:7.2f} ms  (+{p[1] - d[1]:.2f} ms, {p[1] / d[1]:.1f}x)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sections = ap.add_subparsers(dest="section", required=True)
    t = sections.add_parser("tokenize", help="a whole answer's record against one tokenization of its text")
    t.add_argument("--chars", type=int, default=256 << 10)
    t.add_argument("--repeats", type=int, default=3)
    r = sections.add_parser("relay", help="TTFB and TTLB of a whole answer, direct and through the proxy")
    r.add_argument("--prompt-ids", type=int, default=1_000_000)
    r.add_argument("--text-chars", type=int, default=4096)
    r.add_argument("--requests", type=int, default=20)
    r.add_argument("--client-ids", action="store_true", help="the client asks for the ids (return_token_ids)")
    args = ap.parse_args()
    {"tokenize": tokenize, "relay": relay}[args.section](args)


if __name__ == "__main__":
    main()
