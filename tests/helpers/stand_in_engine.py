"""A stand-in for a vLLM OpenAI server on 127.0.0.1: answers ``/health`` and
``/v1/completions`` (streamed when asked: two chunks, then ``[DONE]``) and records each
completion's body with when it started and ended, and the session it named."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass(frozen=True)
class Seen:
    body: dict[str, Any]
    start: float
    end: float
    session: str | None = None  # its X-Session-ID header


class StandInEngine:
    """Contract: ``url`` serves until ``close``; each completion waits ``delay`` seconds,
    then answers 500 where ``fail(body)`` says so, else 200; ``arrived`` lists their
    bodies as they came, ``seen`` each with when it started and ended, as they ended."""

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay
        self.fail = lambda body: False
        self.seen: list[Seen] = []
        self.arrived: list[dict[str, Any]] = []  # every completion's body, as it came
        self._lock = threading.Lock()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._httpd.daemon_threads = True
        threading.Thread(target=self._httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                self._answer(200, b"{}")

            def do_POST(self) -> None:
                start = time.monotonic()
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with engine._lock:
                    engine.arrived.append(body)
                time.sleep(engine.delay)
                if engine.fail(body):
                    self._answer(500, b'{"error": "stand-in failure"}')
                elif body.get("stream"):
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.end_headers()
                    for text in ("w1", " w2"):
                        chunk = {"choices": [{"index": 0, "text": text}]}
                        self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                    self.wfile.write(b"data: [DONE]\n\n")
                else:
                    self._answer(200, json.dumps({"id": "x", "object": "text_completion",
                                                  "choices": [{"index": 0, "text": "w1",
                                                               "finish_reason": "length"}]}).encode())
                with engine._lock:
                    engine.seen.append(Seen(body, start, time.monotonic(),
                                            self.headers.get("X-Session-ID")))

            def _answer(self, status: int, data: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        return Handler
