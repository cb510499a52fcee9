"""The simulated vLLM's HTTP front: what a client, kvwatch's scraper and the real-engine
validation's load generator talk to — the same routes, bodies and answers as vLLM 0.26.0's
OpenAI server where they matter:

* ``GET /metrics`` (Prometheus text), ``GET /health``;
* ``POST /v1/completions`` with ``"prompt": [token ids]`` (or a batch of one), ``max_tokens``
  (default 16); the answer's ``usage.prompt_tokens_details.cached_tokens`` is what the
  prefix cache (and the CPU tier) served;
* with ``VLLM_SERVER_DEV_MODE=1``: ``POST /reset_prefix_cache`` → ``{"success": bool}``,
  ``POST /sleep?level=N``, ``POST /wake_up``, ``GET /is_sleeping``.
"""

from __future__ import annotations

import json
import threading
import urllib.parse
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

MAX_BODY = 8 << 20


class Engine(Protocol):
    dev_mode: bool
    model: str

    def metrics_text(self) -> bytes: ...

    def complete(
        self, prompt: list[int], max_tokens: int, keys: tuple[str | None, str | None] = (None, None)
    ) -> dict[str, Any] | None: ...

    def reset_prefix_cache(self) -> bool: ...

    def sleep(self, level: int) -> None: ...

    def wake_up(self) -> None: ...

    def is_sleeping(self) -> bool: ...


def _prompt(body: dict[str, Any]) -> list[int]:
    p = body.get("prompt")
    if isinstance(p, list) and p and isinstance(p[0], list):
        p = p[0]
    if not isinstance(p, list) or not p or not all(isinstance(t, int) and t >= 0 for t in p):
        raise ValueError("prompt must be a non-empty list of token ids")
    return p


def _tenancy(body: dict[str, Any], served: str) -> tuple[str | None, str | None]:
    """vLLM's OpenAI server: ``cache_salt`` per request; a ``model`` other than the served one
    names a LoRA adapter."""
    salt, model = body.get("cache_salt"), body.get("model")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ValueError("cache_salt must be a non-empty string")
    lora = model if isinstance(model, str) and model and model != served else None
    return salt, lora


def handler(engine: Engine) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            return None

        def _send(self, code: int, body: bytes, ctype: str = "application/json") -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _json(self, code: int, obj: object) -> None:
            self._send(code, json.dumps(obj).encode())

        def do_GET(self) -> None:
            path = urllib.parse.urlsplit(self.path).path
            if path == "/metrics":
                self._send(200, engine.metrics_text(), "text/plain; version=0.0.4; charset=utf-8")
            elif path == "/health":
                self._send(200, b"")
            elif path == "/is_sleeping" and engine.dev_mode:
                self._json(200, {"is_sleeping": engine.is_sleeping()})
            else:
                self._json(404, {"detail": "Not Found"})

        def do_POST(self) -> None:
            url = urllib.parse.urlsplit(self.path)
            n = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(min(n, MAX_BODY)) if n else b""
            routes: dict[str, Callable[[dict[str, list[str]], bytes], None]] = {"/v1/completions": self._complete}
            if engine.dev_mode:
                routes.update({"/reset_prefix_cache": self._reset, "/sleep": self._sleep, "/wake_up": self._wake_up})
            route = routes.get(url.path)
            if route is None:
                self._json(404, {"detail": "Not Found"})
                return
            route(urllib.parse.parse_qs(url.query), raw)

        def _complete(self, _q: dict[str, list[str]], raw: bytes) -> None:
            try:
                body = json.loads(raw or b"{}")
                prompt = _prompt(body)
                max_tokens = int(body.get("max_tokens") or 16)
                keys = _tenancy(body, engine.model)
            except (ValueError, TypeError) as err:
                self._json(400, {"error": {"message": str(err), "type": "BadRequestError"}})
                return
            out = engine.complete(prompt, max_tokens, keys)
            if out is None:
                self._json(503, {"error": {"message": "request aborted", "type": "ServiceUnavailableError"}})
                return
            self._json(200, {"object": "text_completion", "model": engine.model, **out})

        def _reset(self, _q: dict[str, list[str]], _raw: bytes) -> None:
            self._json(200, {"success": engine.reset_prefix_cache()})

        def _sleep(self, q: dict[str, list[str]], _raw: bytes) -> None:
            engine.sleep(int(q.get("level", ["1"])[0]))
            self._send(200, b"")

        def _wake_up(self, _q: dict[str, list[str]], _raw: bytes) -> None:
            engine.wake_up()
            self._send(200, b"")

    return Handler


class Server:
    def __init__(self, engine: Engine, host: str, port: int) -> None:
        self.httpd = ThreadingHTTPServer((host, port), handler(engine))
        self.httpd.daemon_threads = True
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="sim-vllm-http", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self.httpd.server_address[1])

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
