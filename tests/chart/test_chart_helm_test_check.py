"""The `helm test` Pod's script (charts/pagefleet/files/helm_test_check.py), run here
against stand-ins on loopback: an HTTP server for the operator's liveness endpoint and an
HTTPS "API server" with a self-signed certificate, the ServiceAccount's token and CA in
a temporary directory instead of /var/run/secrets."""

from __future__ import annotations

import http.server
import importlib.util
import json
import shutil
import ssl
import subprocess
import threading

import pytest

from tests.chart.chart_render import CHART_DIR

SCRIPT = CHART_DIR / "files" / "helm_test_check.py"
TOKEN = "sa-token"
LIST_PATH = "/apis/pagefleet.dev/v1alpha1/namespaces/ml/inferenceservices"


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # http.server's name
        if self.path == "/healthz":
            status, body = 200, {"status": "ok"}
        elif self.path == LIST_PATH and self.headers["Authorization"] == f"Bearer {TOKEN}":
            status, body = 200, {"items": [{}, {}]}
        else:
            status, body = 403, {"message": "forbidden"}
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def serve(context: ssl.SSLContext | None = None) -> http.server.HTTPServer:
    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    if context is not None:
        server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture
def check(tmp_path, monkeypatch):
    """The script as a module, its ServiceAccount directory and API server on loopback."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make the API server's certificate")
    cert, key = tmp_path / "ca.crt", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"]
        + ["-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"]
        + ["-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
    )
    (tmp_path / "token").write_text(TOKEN + "\n")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    api, health = serve(context), serve()
    spec = importlib.util.spec_from_file_location("helm_test_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "ACCOUNT", str(tmp_path))
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(api.server_address[1]))
    monkeypatch.setenv(
        "OPERATOR_HEALTH_URL", f"http://127.0.0.1:{health.server_address[1]}/healthz"
    )
    monkeypatch.setenv("WATCHED_NAMESPACE", "ml")
    yield module
    api.shutdown()
    health.shutdown()


def test_passes_when_the_operator_and_the_api_answer(check, capsys):
    check.main()
    out = capsys.readouterr().out
    assert "operator liveness" in out and "HTTP 200" in out
    assert "InferenceService API answers: 2 in namespace ml" in out


def test_fails_naming_the_namespace_when_the_api_refuses(check, monkeypatch):
    monkeypatch.setenv("WATCHED_NAMESPACE", "other")
    with pytest.raises(SystemExit, match="InferenceServices in other: HTTP 403"):
        check.main()


def test_fails_naming_the_url_when_the_operator_is_down(check, monkeypatch):
    monkeypatch.setattr(check, "DEADLINE_SECONDS", 0)
    monkeypatch.setenv("OPERATOR_HEALTH_URL", "http://127.0.0.1:9/healthz")
    with pytest.raises(SystemExit, match=r"127\.0\.0\.1:9/healthz did not answer"):
        check.main()
