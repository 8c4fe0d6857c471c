"""The capture proxy in front of upstreams other than plain http://HOST:PORT: an https upstream (a
real local TLS server, its self-signed certificate made here) and an upstream mounted under a path
prefix (http://HOST:PORT/prefix, or given as an OpenAI base URL, .../prefix/v1). Each is checked
the way test_capture_proxy.py checks the plain one: the client's bytes identical with and without
the proxy, and the record holding the upstream's token ids."""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import ssl
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI

from capture_upstream import ProxyThread, ServerThread, Upstream, cli_proxy
from cachelab.capture.proxy import ProxyConfig
from cachelab.capture.recorder import Recorder
from cachelab.capture.to_trace import read_requests

PROMPT = "Which Engram rows stay in HBM?"
CASES = [("/v1/completions", {"prompt": PROMPT}),
         ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}]})]


def self_signed(directory: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and localhost, signed by its own key: (cert.pem, key.pem)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "cachelab capture test upstream")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


def _raw(base: str, path: str, body: dict, ca: Path | None = None) -> tuple[int, bytes]:
    verify = ssl.create_default_context(cafile=str(ca)) if ca else True
    with httpx.stream("POST", base + path, json=body, timeout=30, verify=verify) as r:
        return r.status_code, b"".join(r.iter_raw())


def _check_faithful_and_recorded(proxy_url: str, direct_url: str, recorder: Recorder, ca: Path | None = None) -> None:
    """Every case, streamed and whole: the same bytes through the proxy as straight from the upstream,
    and a record per proxied request with the upstream's token ids."""
    truths = []
    for path, body in CASES:
        for stream in (False, True):
            req = {"model": "tiny", "max_tokens": 5, "stream": stream, **body}
            direct = _raw(direct_url, path, req, ca)
            assert direct[0] == 200
            assert _raw(proxy_url, path, req) == direct, (path, stream)
            truths.append(json.loads(_raw(direct_url, path, {**req, "stream": False, "return_token_ids": True},
                                          ca)[1]))
    assert recorder.flush(30)
    table = read_requests(recorder.directory)[0]
    assert table.height == len(truths)
    assert table["status"].to_list() == [200] * len(truths) and table["error"].is_null().all()
    assert table["token_source"].to_list() == ["upstream"] * len(truths)
    for row, truth in zip(table.iter_rows(named=True), truths):
        choice = truth["choices"][0]
        assert row["output_ids"] == choice["token_ids"]
        assert row["prompt_ids"] == (truth.get("prompt_token_ids") or choice.get("prompt_token_ids"))


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    """A deterministic upstream served over TLS with a self-signed certificate: (https URL, cert path)."""
    pytest.importorskip("cryptography")
    cert, key = self_signed(tmp_path_factory.mktemp("tls"))
    with ServerThread(Upstream().app, ssl_certfile=str(cert), ssl_keyfile=str(key)) as server:
        yield f"https://127.0.0.1:{server.port}", cert


def test_https_upstream_faithful_and_recorded(tls, tmp_path):
    url, cert = tls
    recorder = Recorder(tmp_path / "cap")
    with ProxyThread(ProxyConfig(upstream=url, upstream_ca=str(cert)), recorder) as proxy:
        _check_faithful_and_recorded(proxy.url, url, recorder, cert)
        # other paths pass through over TLS too
        assert httpx.get(proxy.url + "/v1/models", timeout=10).json()["data"][0]["id"] == "tiny"


def test_https_upstream_certificate_is_verified(tls, tmp_path):
    """Without the certificate's CA the proxy does not talk to the upstream: 502, the reason recorded."""
    url, _ = tls
    recorder = Recorder(tmp_path / "cap")
    with ProxyThread(ProxyConfig(upstream=url), recorder) as proxy:
        status, body = _raw(proxy.url, "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2})
    assert status == 502 and b"CERTIFICATE_VERIFY_FAILED" in body, body
    assert recorder.flush(30)
    rec = read_requests(recorder.directory)[0].row(0, named=True)
    assert rec["status"] == 502 and "CERTIFICATE_VERIFY_FAILED" in rec["error"]


def test_https_upstream_through_the_cli(tls, tmp_path):
    """`cachelab capture proxy --upstream https://... --upstream-ca cert.pem`, the command a user runs."""
    url, cert = tls
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(Path(__file__).resolve().parents[1]),
                                                                    os.environ.get("PYTHONPATH")) if p)}
    with cli_proxy(url, tmp_path / "cap", "--upstream-ca", str(cert), env=env) as (base, _):
        req = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "stream": True}
        assert _raw(base, "/v1/completions", req) == _raw(url, "/v1/completions", req, cert)
        status = httpx.get(base + "/capture/status", timeout=10).json()
        assert status["submitted"] == 1
    assert read_requests(tmp_path / "cap")[0]["status"].to_list() == [200]


def _mounted(prefix: str) -> FastAPI:
    """The deterministic upstream answering only under ``prefix`` (a gateway's route to one model)."""
    app = FastAPI()
    app.mount(prefix, Upstream().app)
    return app


@pytest.fixture(scope="module")
def prefixed():
    with ServerThread(_mounted("/prefix")) as server:
        yield server.url


@pytest.mark.parametrize("given", ["/prefix", "/prefix/", "/prefix/v1", "/prefix/v1/"])
def test_upstream_with_a_path_prefix(prefixed, tmp_path, given):
    """``--upstream http://HOST:PORT/prefix`` and the OpenAI base URL ``.../prefix/v1`` both send a
    client's /v1/... to /prefix/v1/... (not /prefix/v1/v1/...)."""
    assert httpx.get(prefixed + "/v1/models", timeout=10).status_code == 404, "the upstream only answers under /prefix"
    recorder = Recorder(tmp_path / "cap")
    with ProxyThread(ProxyConfig(upstream=prefixed + given), recorder) as proxy:
        _check_faithful_and_recorded(proxy.url, prefixed + "/prefix", recorder)
        assert httpx.get(proxy.url + "/v1/models", timeout=10).json()["data"][0]["id"] == "tiny"


def test_upstream_given_as_an_openai_base_url(tmp_path):
    """``--upstream http://HOST:PORT/v1`` (what a client's base_url holds) reaches the server's /v1/..."""
    with ServerThread(Upstream().app) as server:
        recorder = Recorder(tmp_path / "cap")
        with ProxyThread(ProxyConfig(upstream=server.url + "/v1"), recorder) as proxy:
            _check_faithful_and_recorded(proxy.url, server.url, recorder)
