"""The observer's HTTP server (stdlib only): the dashboard, its JSON API, Prometheus and a health check.

    GET /                the dashboard: one page that draws itself from /api/v1/run every 2 s (no CDN)
    GET /api/v1/run      the run as the observer sees it (run_view.RunLog.view; docs/observer.md)
    GET /metrics         the same, as Prometheus text
    GET /healthz         200 "ok" while the observer's DHT node is up, else 503 and the reason

It serves on a thread of its own; `view` and `healthy` are called on that thread for every request.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any

from p2p_diloco.config import Config
from p2p_diloco.errors import ConfigError
from p2p_diloco.observe.run_view import prometheus
from p2p_diloco.train.metrics import Phase, peer_prometheus

logger = logging.getLogger(__name__)

View = Callable[[], dict[str, Any]]
Health = Callable[[], tuple[bool, str]]


def dashboard_html() -> bytes:
    return resources.files("p2p_diloco").joinpath("observe/static/dashboard.html").read_bytes()


Response = tuple[int, str, bytes]  # (status, content type, body)


class HttpServer:
    """Answers GETs with `routes(path)` on `host`:`port` (0: any free port), on a thread of its
    own, until `close`."""

    def __init__(self, routes: Callable[[str], Response], host: str = "127.0.0.1", port: int = 0):
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                path = self.path.split("?", 1)[0]
                try:
                    status, kind, body = routes(path)
                except Exception as e:  # a bug in a view must not take the server down
                    logger.exception("http: %s failed", path)
                    status, kind, body = 500, "text/plain", f"error: {e}\n".encode()
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Cache-Control", "no-store")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's name)
                logger.debug("http: " + format, *args)

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="http", daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host.decode() if isinstance(host, bytes) else host}:{port}/"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=10)


class ObserverServer(HttpServer):
    """The observer's pages (this module's docstring)."""

    def __init__(self, view: View, healthy: Health, host: str = "127.0.0.1", port: int = 0):
        page = dashboard_html()
        super().__init__(lambda path: route(path, view, healthy, page), host, port)


class MetricsServer(HttpServer):
    """A peer's own /metrics (log.metrics_port) and /healthz."""

    def __init__(self, text: Callable[[], str], host: str = "127.0.0.1", port: int = 0):
        def routes(path: str) -> Response:
            if path == "/metrics":
                return 200, "text/plain; version=0.0.4; charset=utf-8", text().encode()
            if path == "/healthz":
                return 200, "text/plain", b"ok\n"
            return 404, "text/plain", b"not found: try /metrics or /healthz\n"

        super().__init__(routes, host, port)


def route(path: str, view: View, healthy: Health, page: bytes) -> Response:
    """(status, content type, body) for a GET of `path`."""
    if path in ("/", "/index.html"):
        return 200, "text/html; charset=utf-8", page
    if path == "/api/v1/run":
        return 200, "application/json", json.dumps(view(), allow_nan=False).encode()
    if path == "/metrics":
        return 200, "text/plain; version=0.0.4; charset=utf-8", prometheus(view()).encode()
    if path == "/healthz":
        ok, why = healthy()
        return (200, "text/plain", b"ok\n") if ok else (503, "text/plain", f"unhealthy: {why}\n".encode())
    return 404, "text/plain", b"not found: try /, /api/v1/run, /metrics or /healthz\n"


def serve_peer_metrics(
    config: Config, peer_id: str, latest: Callable[[], dict[str, Any] | None], phase: Phase | None = None
) -> MetricsServer:
    """A peer's /metrics on log.metrics_host:log.metrics_port, from `latest()` (its last round
    record) and its `phase` now; ConfigError if the port cannot be served."""
    log = config.log

    def text() -> str:
        return peer_prometheus(latest(), config.run.run_id, peer_id, phase)

    try:
        return MetricsServer(text, log.metrics_host, log.metrics_port)
    except OSError as e:
        raise ConfigError(
            f"log.metrics_port {log.metrics_port} on {log.metrics_host} cannot be served ({e.strerror}); "
            f"choose another port, or 0 for none"
        ) from None
