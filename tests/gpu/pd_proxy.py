"""A prefill/decode proxy for vLLM 0.26.0's NixlConnector on one GPU (issue 26), standard library only.

The request flow is that of vLLM's own toy proxy (``tests/v1/kv_connector/nixl_integration/toy_proxy_server.py``
in the vLLM repository), with the fields that vLLM 0.26.0 reads
(``vllm/distributed/kv_transfer/kv_connector/v1/nixl/pull_scheduler.py`` and ``metadata.py``):

1. ``POST /v1/completions`` (or ``/v1/chat/completions``) arrives. Only non-streaming requests are taken.
2. The body goes to the prefill instance (``kv_role`` ``kv_producer``) with ``max_tokens`` 1 (and
   ``max_completion_tokens`` 1 where given), ``stream`` false, without ``min_tokens``/``min_completion_tokens``,
   and ``kv_transfer_params`` ``{"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id":
   null, "remote_block_ids": null, "remote_host": null, "remote_port": null}``. Prefill computes the prompt's
   KV; ``request_finished()`` keeps its blocks (``kv_lease_duration``, 30 s) and puts ``{"do_remote_prefill":
   true, "do_remote_decode": false, "remote_block_ids": [[...]], "remote_engine_id", "remote_request_id",
   "remote_host", "remote_port", "tp_size", "remote_num_tokens", "remote_blocks_expiry_time"}`` in the
   response's ``kv_transfer_params``.
3. The original body, with those ``kv_transfer_params``, goes to the decode instance (``kv_consumer``). Its
   scheduler counts the prompt as external tokens, its worker reads the blocks with one NIXL READ per request
   (``make_prepped_xfer`` + ``transfer``, ``pull_worker.py`` ``_read_blocks``), recomputes the last prompt
   token and decodes. Without ``kv_transfer_params`` from prefill, decode gets the plain request (recompute).
4. Decode's status and body go back to the client unchanged. Both calls carry the same ``X-Request-Id``.

Each request writes one JSON line to ``--log``: the X-Request-Id, ``wall_start`` (``time.time()``), ``mono_ns``
(``time.monotonic_ns()``: CLOCK_MONOTONIC, the clock of ``bpf_ktime_get_ns``, so lines align with kvwatch's
transfer events) at ``received``, ``prefill_sent``, ``prefill_done``, ``decode_sent``, ``decode_first_byte``
(decode's status line and headers read) and ``done``, the prompt tokens (prefill's ``usage``), the number of
remote blocks, prefill's ``kv_transfer_params``, decode's ``usage`` and ``metrics`` (``--enable-prompt-tokens-details``,
``--enable-per-request-metrics`` on decode), and the error, if any.

    python3 tests/gpu/pd_proxy.py --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 \\
        --port 8000 --log /tmp/pd_requests.jsonl
"""

from __future__ import annotations

import argparse
import http.client
import json
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

PATHS = ("/v1/completions", "/v1/chat/completions")
PREFILL_KV_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


class Backend:
    """One vLLM instance; a fresh connection per call (the proxy keeps no pool)."""

    def __init__(self, url: str, timeout: float) -> None:
        parts = urlsplit(url)
        self.host, self.port, self.timeout = parts.hostname or "127.0.0.1", parts.port or 80, timeout

    def call(self, method: str, path: str, body: bytes | None, headers: dict, marks: dict, name: str):
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        try:
            marks[f"{name}_sent"] = time.monotonic_ns()
            conn.request(method, path, body=body, headers=headers)
            resp = conn.getresponse()
            marks[f"{name}_first_byte"] = time.monotonic_ns()
            data = resp.read()
            marks[f"{name}_done"] = time.monotonic_ns()
            return resp.status, data, resp.getheader("Content-Type") or "application/json"
        finally:
            conn.close()


class Recorder:
    def __init__(self, path: str) -> None:
        self.lock = threading.Lock()
        self.file = open(path, "a", buffering=1)  # noqa: SIM115 - one file for the server's lifetime

    def write(self, record: dict) -> None:
        line = json.dumps(record, separators=(",", ":"))
        with self.lock:
            self.file.write(line + "\n")


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive for benchmark clients; every reply has a Content-Length
    prefill: Backend
    decode: Backend
    recorder: Recorder

    def log_message(self, format, *args):  # quiet: the JSONL log is the record
        pass

    def reply(self, status: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path != "/health":
            self.reply(404, b'{"error":"not found"}')
            return
        states = {}
        for name, backend in (("prefill", self.prefill), ("decode", self.decode)):
            try:
                states[name] = backend.call("GET", "/health", None, {}, {}, "health")[0]
            except OSError as e:
                states[name] = str(e)
        ok = all(s == 200 for s in states.values())
        self.reply(200 if ok else 503, json.dumps(states).encode())

    def do_POST(self) -> None:
        marks = {"received": time.monotonic_ns()}
        rec: dict = {"id": str(uuid.uuid4()), "path": self.path, "wall_start": time.time(), "mono_ns": marks}
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.path not in PATHS:
            self.reply(404, b'{"error":"not found"}')
            return
        try:
            req = json.loads(raw)
        except ValueError:
            self.reply(400, b'{"error":"body is not JSON"}')
            return
        if req.get("stream"):
            self.reply(400, b'{"error":"pd_proxy takes non-streaming requests only"}')
            return
        headers = {"Content-Type": "application/json", "X-Request-Id": rec["id"]}
        status, body, ctype = 502, b"", "application/json"
        try:
            status, body, ctype = self.forward(req, headers, marks, rec)
        except (OSError, http.client.HTTPException, ValueError) as e:
            rec["error"] = f"{type(e).__name__}: {e}"
            status, body = 502, json.dumps({"error": rec["error"]}).encode()
        try:
            self.reply(status, body, ctype)
        finally:  # recorded even when the client has gone
            marks["done"] = time.monotonic_ns()
            rec["status"] = status
            self.recorder.write(rec)

    def forward(self, req: dict, headers: dict, marks: dict, rec: dict) -> tuple[int, bytes, str]:
        p_req = dict(req, kv_transfer_params=dict(PREFILL_KV_PARAMS), stream=False, max_tokens=1)
        if "max_completion_tokens" in p_req:
            p_req["max_completion_tokens"] = 1
        for key in ("stream_options", "min_tokens", "min_completion_tokens"):
            p_req.pop(key, None)
        if isinstance(req.get("prompt"), list) and all(isinstance(t, int) for t in req["prompt"]):
            rec["prompt_ids"] = len(req["prompt"])
        status, body, ctype = self.prefill.call(
            "POST", self.path, json.dumps(p_req).encode(), headers, marks, "prefill"
        )
        if status != 200:
            rec["error"] = f"prefill answered {status}"
            return status, body, ctype
        p_resp = json.loads(body)
        kv = p_resp.get("kv_transfer_params")
        rec["prompt_tokens"] = (p_resp.get("usage") or {}).get("prompt_tokens")
        rec["kv_transfer_params"] = kv
        rec["remote_blocks"] = sum(len(g) for g in kv.get("remote_block_ids") or []) if kv else None
        d_req = dict(req, kv_transfer_params=kv) if kv else req
        status, body, ctype = self.decode.call("POST", self.path, json.dumps(d_req).encode(), headers, marks, "decode")
        if status != 200:
            rec["error"] = f"decode answered {status}"
            return status, body, ctype
        d_resp = json.loads(body)
        rec["decode_usage"] = d_resp.get("usage")
        rec["decode_metrics"] = d_resp.get("metrics")
        return status, body, ctype


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--prefill", default="http://127.0.0.1:8100", help="prefill instance (kv_producer)")
    ap.add_argument("--decode", default="http://127.0.0.1:8200", help="decode instance (kv_consumer)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--log", required=True, help="JSONL file, one line per request (appended)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per backend call")
    args = ap.parse_args()
    Handler.prefill = Backend(args.prefill, args.timeout)
    Handler.decode = Backend(args.decode, args.timeout)
    Handler.recorder = Recorder(args.log)
    server = ThreadingHTTPServer((args.host, args.port), Handler)
    server.daemon_threads = True
    print(
        f"pd_proxy on {args.host}:{args.port}: prefill {args.prefill}, decode {args.decode}, log {args.log}", flush=True
    )
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
