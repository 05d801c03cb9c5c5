"""A Chroma server that requires a token, over http and https: the client sends the token, verifies the
certificate against a given CA, and says clearly when the token is missing or wrong.

`chroma run` (chromadb 1.x's Rust server) has no authentication, so the server here is chromadb's Python server
(`uvicorn chromadb.app:app`) with chromadb's own `TokenAuthenticationServerProvider`, on a free loopback port."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("chromadb")
for _module in ("uvicorn", "fastapi", "opentelemetry.instrumentation.fastapi"):
    pytest.importorskip(_module, reason="chromadb's Python server needs the test extra (fastapi, uvicorn, ...)")

from cacheblend_rag.errors import ConfigError, VectorStoreError  # noqa: E402
from cacheblend_rag.retrieval.chroma import ChromaChunkStore  # noqa: E402

TOKEN = "s3cret-token"
REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _self_signed(folder: Path) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make a test certificate")
    key, cert = folder / "key.pem", folder / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    return key, cert


def _serve(folder: Path, *, tls: tuple[Path, Path] | None = None):
    port = _free_port()
    env = {**os.environ, "IS_PERSISTENT": "1", "PERSIST_DIRECTORY": str(folder / "db"),
           "ANONYMIZED_TELEMETRY": "False",
           "CHROMA_SERVER_AUTHN_PROVIDER": "chromadb.auth.token_authn.TokenAuthenticationServerProvider",
           "CHROMA_SERVER_AUTHN_CREDENTIALS": TOKEN}
    cmd = [sys.executable, "-m", "uvicorn", "chromadb.app:app", "--host", "127.0.0.1", "--port", str(port)]
    if tls is not None:
        cmd += ["--ssl-keyfile", str(tls[0]), "--ssl-certfile", str(tls[1])]
    log = open(folder / "server.log", "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=folder)
    scheme = "https" if tls else "http"
    import ssl

    context = ssl.create_default_context(cafile=str(tls[1])) if tls else None
    deadline = time.monotonic() + 120
    while True:
        try:
            urllib.request.urlopen(f"{scheme}://127.0.0.1:{port}/api/v2/heartbeat", timeout=2, context=context).read()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                log.close()
                pytest.fail(f"chroma server did not start: {(folder / 'server.log').read_text()[-2000:]}")
            time.sleep(0.5)
    return proc, port, log


def _stop(proc, log) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


@pytest.fixture
def token_server(tmp_path):
    proc, port, log = _serve(tmp_path)
    yield port
    _stop(proc, log)


@pytest.mark.slow
def test_token_is_required_and_checked(token_server, monkeypatch):
    monkeypatch.delenv("CACHEBLEND_RAG_CHROMA_TOKEN", raising=False)
    with pytest.raises(VectorStoreError, match="requires a token: pass --chroma-token"):
        ChromaChunkStore(host="127.0.0.1", port=token_server, collection="auth_test")
    with pytest.raises(VectorStoreError, match="token was refused"):
        ChromaChunkStore(host="127.0.0.1", port=token_server, collection="auth_test", token="wrong")
    store = ChromaChunkStore(host="127.0.0.1", port=token_server, collection="auth_test", token=TOKEN)
    assert store.count() == 0 and store.location == f"http://127.0.0.1:{token_server}"
    monkeypatch.setenv("CACHEBLEND_RAG_CHROMA_TOKEN", TOKEN)  # the environment variable works the same
    assert ChromaChunkStore(host="127.0.0.1", port=token_server, collection="auth_test").count() == 0


@pytest.mark.slow
def test_cli_names_a_refused_token(token_server, tmp_path):
    env = {**os.environ, "CACHEBLEND_RAG_CHROMA_TOKEN": "wrong", "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-m", "cacheblend_rag.cli", "ask", "q", "--home", str(tmp_path), "--host",
                          "127.0.0.1", "--port", str(token_server)], capture_output=True, text=True, env=env,
                         timeout=300, cwd=REPO)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith("error: Chroma at http://127.0.0.1:")
    assert "token was refused" in out.stderr


@pytest.mark.slow
def test_https_with_a_private_ca(tmp_path, monkeypatch):
    monkeypatch.delenv("CACHEBLEND_RAG_CHROMA_TOKEN", raising=False)
    key, cert = _self_signed(tmp_path)
    proc, port, log = _serve(tmp_path, tls=(key, cert))
    try:
        store = ChromaChunkStore(host="127.0.0.1", port=port, collection="tls_test", token=TOKEN, ssl=True,
                                 ca_bundle=cert)
        assert store.location == f"https://127.0.0.1:{port}" and store.count() == 0
        with pytest.raises(VectorStoreError, match="cannot reach Chroma at https://"):  # not trusted: refused
            ChromaChunkStore(host="127.0.0.1", port=port, collection="tls_test", token=TOKEN, ssl=True)
        with pytest.raises(VectorStoreError, match="--chroma-ssl"):  # http to an https server
            ChromaChunkStore(host="127.0.0.1", port=port, collection="tls_test", token=TOKEN)
    finally:
        _stop(proc, log)


def test_server_options_need_a_server(tmp_path):
    with pytest.raises(ConfigError, match="--host"):
        ChromaChunkStore(tmp_path, token=TOKEN)
    with pytest.raises(ConfigError, match="no such file"):
        ChromaChunkStore(host="127.0.0.1", port=1, ca_bundle=tmp_path / "missing.pem")
