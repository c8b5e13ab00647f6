"""An OpenAI-compatible HTTP endpoint on 127.0.0.1, one base_url per episode: how an agent written against the
`openai` client reaches the engine during a rollout (`rollouts.agents`).

    endpoint = Endpoint(model_name)               # binds 127.0.0.1 on a free port, serves in daemon threads
    endpoint.open(key, episode)                   # episode.call(request: dict) -> a chat completion (dict)
    client = openai.OpenAI(base_url=endpoint.base_url(key), api_key=key)
    endpoint.shut(key); endpoint.close()

Routes, each under `/episodes/<key>/v1` or under `/v1` with the episode's key as the API key (`Authorization:
Bearer <key>`): `POST /chat/completions` (streamed as server-sent events when the request says `stream: true`)
and `GET /models`. Each request is handled on its own thread, which blocks in `episode.call` until the rollout's
loop has generated the answer; an `ApiError` raised there is the HTTP error the client sees (OpenAI's error
body). This module knows the wire format only: no engine, no tokenizer, no episode record.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Optional

PREFIX = "/episodes/"


class ApiError(Exception):
    """An HTTP error answered to the client: `status`, OpenAI's error `kind` (invalid_request_error, ...)."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


class Endpoint:
    """The HTTP server; see the module docstring."""

    def __init__(self, model_name: str, host: str = "127.0.0.1"):
        self.model_name = model_name
        self._episodes: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._server = _Server((host, 0), _handler_for(self))
        self.host, self.port = self._server.server_address[:2]
        self._thread = threading.Thread(target=self._server.serve_forever, name="tidyrl-endpoint", daemon=True)
        self._thread.start()

    def base_url(self, key: str) -> str:
        return f"http://{self.host}:{self.port}{PREFIX}{key}/v1"

    def open(self, key: str, episode) -> None:
        with self._lock:
            self._episodes[key] = episode

    def shut(self, key: str) -> None:
        """The episode is over: its later calls are answered 410 (an agent left running past its end)."""
        with self._lock:
            self._episodes.pop(key, None)

    def episode(self, key: Optional[str]):
        with self._lock:
            found = self._episodes.get(key) if key else None
        if found is None:
            raise ApiError(410 if key else 401, f"no open episode {key!r} on this endpoint (it ended, or the "
                           "base_url or API key is not one tidyrl gave)" if key else
                           "no episode: use the base_url tidyrl gave (/episodes/<key>/v1) or its key as the API key",
                           "invalid_request_error" if key else "authentication_error")
        return found

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024
    """The listen backlog: every agent of a round may connect at once (the default, 5, resets connections)."""


def _handler_for(endpoint: Endpoint):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True  # (headers and body are two writes: Nagle's algorithm held each answer 40 ms)

        def log_message(self, *args) -> None:  # (no access log on stderr)
            pass

        def do_GET(self) -> None:
            self._serve("GET")

        def do_POST(self) -> None:
            self._serve("POST")

        def _serve(self, method: str) -> None:
            try:
                key, route = self._route()
                if method == "GET" and route == "/models":
                    endpoint.episode(key)
                    self._json(200, {"object": "list", "data": [
                        {"id": endpoint.model_name, "object": "model", "created": 0, "owned_by": "tidyrl"}]})
                elif method == "POST" and route == "/chat/completions":
                    request = self._body()
                    completion = endpoint.episode(key).call(request)
                    if request.get("stream"):
                        self._stream(completion, bool((request.get("stream_options") or {}).get("include_usage")))
                    else:
                        self._json(200, completion)
                else:
                    raise ApiError(404, f"{method} {self.path}: tidyrl serves POST .../v1/chat/completions and "
                                   "GET .../v1/models")
            except ApiError as err:
                self._json(err.status, {"error": {"message": err.message, "type": err.kind, "param": None,
                                                  "code": None}})
            except Exception as err:  # a fault of the endpoint itself: the agent sees it, the run goes on
                self._json(500, {"error": {"message": f"{type(err).__name__}: {err}", "type": "server_error",
                                           "param": None, "code": None}})

        def _route(self) -> tuple[Optional[str], str]:
            path = self.path.split("?", 1)[0].rstrip("/")
            if path.startswith(PREFIX):
                key, _, rest = path[len(PREFIX):].partition("/")
            else:
                auth = self.headers.get("Authorization", "")
                key, rest = (auth[7:].strip() if auth.lower().startswith("bearer ") else None), path.lstrip("/")
            if not (rest == "v1" or rest.startswith("v1/")):
                raise ApiError(404, f"{self.path}: not under /v1")
            return key, rest[2:]

        def _body(self) -> dict:
            size = int(self.headers.get("Content-Length") or 0)
            try:
                body = json.loads(self.rfile.read(size) or b"{}")
            except json.JSONDecodeError as err:
                raise ApiError(400, f"the request body is not JSON ({err.msg})") from None
            if not isinstance(body, dict):
                raise ApiError(400, "the request body is not a JSON object")
            return body

        def _json(self, status: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _stream(self, completion: dict, include_usage: bool) -> None:
            """The completion as server-sent events, OpenAI's chunks: the role, the content, each tool call, the
            finish reason, the usage when asked, then [DONE]. The whole answer exists when streaming starts."""
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")
            self.end_headers()
            choice = completion["choices"][0]
            message = choice["message"]
            head = {k: completion[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}

            def send(delta: Optional[dict], finish: Optional[str] = None, usage: Optional[dict] = None) -> None:
                chunk = head | {"choices": [] if delta is None else
                                [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
                if usage is not None:
                    chunk["usage"] = usage
                self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")

            send({"role": "assistant", "content": ""})
            if message.get("content"):
                send({"content": message["content"]})
            for index, call in enumerate(message.get("tool_calls") or []):
                send({"tool_calls": [{"index": index, **call}]})
            send({}, choice["finish_reason"])
            if include_usage:
                send(None, usage=completion["usage"])
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
            self.close_connection = True

    return Handler


__all__ = ["ApiError", "Endpoint"]
