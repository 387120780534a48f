"""`moeserve serve`: the OpenAI-compatible HTTP server (FastAPI on uvicorn) over an Engine.

The engine's ranks run in worker processes; this process tokenizes, renders chat templates,
formats responses and streams them. The server listens while the engine starts (its ranks load
their weights, compile every kernel variant of the plan and capture their graphs): until it is
ready, /health answers 503 "starting" and every other route 503 with Retry-After. SIGTERM or
SIGINT (Ctrl-C) drains (server/lifecycle.py): /health and new requests answer 503 (the socket
stays open, so that a load balancer sees the 503 rather than a refused connection), requests
in flight finish; those left after --drain-timeout seconds end with an error (a stream: an
error event, then [DONE]; server/streaming.py); the engine shuts down, and the process exits 0.
A second signal stops at once. When the engine fails (a rank died, or the watchdog found no
step finished in --watchdog-timeout seconds), every request in flight gets an error, /health
answers 503, and the process exits 1, for a supervisor to restart it.

With --api-key every route but /health asks for `Authorization: Bearer KEY`; POST bodies are
JSON only and at most --max-request-bytes (server/guard.py); CORS headers are sent only for the
--allowed-origins. Prompts are tokenized and chat templates rendered in worker threads, so that a
large prompt does not hold up /health or other streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import signal
import socket
import time
from typing import Any, AsyncIterator, Callable, Optional, Sequence

import uvicorn
from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from moeserve.config import EngineConfig
from moeserve.runtime.engine import Engine
from moeserve.server.bridge import EngineClient
from moeserve.server.connection import timed_h11_protocol
from moeserve.server.errors import (APIError, internal_error, new_request_id, public_line,
                                   traceback_text)
from moeserve.server.guard import (DEFAULT_MAX_REQUEST_BYTES, DEFAULT_REQUEST_READ_TIMEOUT_S,
                                   RequestGuard)
from moeserve.server.lifecycle import (DRAIN_GRACE_S, ServerState, drain_when_asked,
                                      wait_for_engine, watch_engine)
from moeserve.server.openai_api import Job, OpenAIHandlers
from moeserve.server.streaming import EventStream, unless_disconnected
from moeserve.server.text import TextCodec
from moeserve.server.tokenize_api import TokenizeHandlers

log = logging.getLogger("moeserve.server")
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/plan", "/health",
             "/metrics", "/tokenize", "/detokenize")
STARTING_RETRY_S = 5  # Retry-After while the engine starts


def build_app(engine: Engine, *, served_model_name: Optional[str] = None, max_queue: int = 1024,
              on_engine_death: Optional[Callable[[str], None]] = None,
              api_key: Optional[str] = None, allowed_origins: Sequence[str] = (),
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, drain_timeout: float = 600.0,
              on_drained: Optional[Callable[[], None]] = None,
              request_read_timeout: float = DEFAULT_REQUEST_READ_TIMEOUT_S,
              tool_call_parser: Optional[str] = None, reasoning_parser: Optional[str] = None,
              chat_template: Optional[str] = None) -> FastAPI:
    """`chat_template`: the text of a template that replaces the checkpoint's."""
    if engine.tokenizer is None:
        raise ValueError("moeserve serve needs the model's tokenizer (prompts, chat templates, "
                         "stop strings); drop --skip-tokenizer-init")
    name = served_model_name or engine.cfg.model
    served = [name] + ([engine.cfg.model] if engine.cfg.model != name else [])
    assert engine.plan.budget is not None
    ctx = engine.plan.budget.context_length
    client = EngineClient(engine, max_queue)
    codec = TextCodec(engine.tokenizer, engine.spec.vocab_size, chat_template)
    handlers = OpenAIHandlers(client, codec, served, ctx, tool_call_parser, reasoning_parser)
    tokens = TokenizeHandlers(codec, served, ctx)
    state = ServerState()
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        start = asyncio.create_task(wait_for_engine(engine))
        watch = asyncio.create_task(watch_engine(client, state, on_engine_death))
        drain = asyncio.create_task(drain_when_asked(client, state, drain_timeout, on_drained))
        yield
        for task in (start, watch, drain):
            task.cancel()

    # no 307 to the slash-less path: a client that posts to /v1/completions/ gets a 404 body
    app = FastAPI(title="moeserve", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None, redirect_slashes=False)
    app.state.server = state
    app.state.client = client

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(exc.status_code, str(exc.detail), None,
                        "not_found" if exc.status_code == 404 else None).response()

    @app.exception_handler(ClientDisconnect)
    async def _gone(request: Request, _: ClientDisconnect) -> Response:
        log.debug("the client closed the connection while sending %s %s", request.method,
                  request.url.path)
        return Response(status_code=499)  # nobody reads it; counted in the metrics

    @app.exception_handler(Exception)
    async def _crash(_: Request, exc: Exception) -> JSONResponse:
        return internal_error(log, new_request_id(), "internal error",
                              traceback_text(exc)).response()

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> JSONResponse:
        if state.engine_failed or not client.alive:
            failure = state.engine_failed or client.failure  # the watch task lags by a tick
            why = None if failure is None else public_line(failure)
            return JSONResponse({"status": "engine failed", "error": why}, status_code=503)
        if state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if not engine.ready:
            return JSONResponse({"status": "starting"}, status_code=503,
                                headers={"Retry-After": str(STARTING_RETRY_S)})
        return JSONResponse({"status": "ok"})

    def model_card(model_id: str) -> dict[str, Any]:
        return {"id": model_id, "object": "model", "created": created, "owned_by": "moeserve",
                "root": engine.cfg.model, "max_model_len": ctx}

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [model_card(name)]})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> JSONResponse:
        if model_id not in served:
            raise APIError(404, f"the model '{model_id}' does not exist", "model",
                           "model_not_found")
        return JSONResponse(model_card(model_id))

    @app.get("/v1/plan")
    async def plan() -> JSONResponse:
        return JSONResponse(engine.plan.to_json())

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(client.metrics.render(),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    async def generate(request: Request, make_job: Callable[[bytes], Job]) -> Response:
        if state.draining:
            raise APIError(503, "the server is shutting down", None, "draining",
                           headers={"Retry-After": "1"})
        body = await request.body()
        job = await asyncio.to_thread(make_job, body)  # tokenizing a long prompt takes a while
        seats = client.reserve(job.num_seqs)
        if job.stream:
            return EventStream(handlers.stream(job, seats), on_close=seats.release,
                               request_id=job.id, expired=state.drain_expired)
        try:
            body = await unless_disconnected(request, handlers.respond(job, seats),
                                              state.drain_expired)
        finally:
            seats.release()
        return JSONResponse(body)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        return JSONResponse(await asyncio.to_thread(tokens.tokenize, await request.body()))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        return JSONResponse(await asyncio.to_thread(tokens.detokenize, await request.body()))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, handlers.completion_job)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await generate(request, handlers.chat_job)

    app.add_middleware(StartingGate, engine=engine)
    app.add_middleware(RequestGuard, api_key=api_key, max_request_bytes=max_request_bytes,
                       read_timeout=request_read_timeout)
    app.add_middleware(CountRequests, client=client)
    if allowed_origins:  # outermost: a browser's preflight carries no API key
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins),
                           allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])
    return app


class StartingGate:
    """ASGI middleware: until the engine is ready, every route but /health answers 503 with
    Retry-After (inside the guard, so that the API key is checked first)."""

    def __init__(self, app: ASGIApp, engine: Engine) -> None:
        self.app, self.engine = app, engine

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] != "http" or self.engine.ready or scope.get("path") == "/health"):
            await self.app(scope, receive, send)
            return
        err = APIError(503, "the engine is starting (loading weights, compiling kernels, "
                       "capturing graphs); retry shortly", None, "starting",
                       headers={"Retry-After": str(STARTING_RETRY_S)})
        await err.response()(scope, receive, send)


class CountRequests:
    """ASGI middleware: moeserve_http_requests{endpoint, status}."""

    def __init__(self, app: ASGIApp, client: EngineClient) -> None:
        self.app, self.client = app, client

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        endpoint = path if path in ENDPOINTS else (
            "/v1/models" if path.startswith("/v1/models/") else "other")
        status = [500]

        async def send_status(msg: Any) -> None:
            if msg["type"] == "http.response.start":
                status[0] = msg["status"]
            await send(msg)

        try:
            await self.app(scope, receive, send_status)
        finally:
            self.client.metrics.requests.labels(endpoint, str(status[0])).inc()


class _Server(uvicorn.Server):
    """uvicorn's server, where SIGTERM and SIGINT both start the app's drain (which stops the
    server when done) instead of closing the socket at once, and a second signal stops now.
    It does not raise the signal again once drained (uvicorn's default), so that `serve` shuts
    the engine down and returns its exit code."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.app_state = state

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.app_state.draining:  # a second signal: stop waiting for requests
            self.should_exit = self.force_exit = True
        self.app_state.draining = True


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def serve(cfg: EngineConfig, *, host: str = "127.0.0.1", port: int = 30000,
          max_queue: int = 1024, served_model_name: Optional[str] = None,
          drain_timeout: float = 600.0, log_level: str = "info", api_key: Optional[str] = None,
          allowed_origins: Sequence[str] = (),
          max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
          request_read_timeout: float = DEFAULT_REQUEST_READ_TIMEOUT_S,
          tool_call_parser: Optional[str] = None, reasoning_parser: Optional[str] = None,
          chat_template: Optional[str] = None) -> int:
    """Run the server until SIGTERM/SIGINT (exit code 0) or an engine failure (1). Port 0 picks
    a free port; the line `moeserve: serving MODEL on http://HOST:PORT` says which."""
    if max_queue < 1:
        raise ValueError(f"--max-queued-requests must be at least 1, got {max_queue}")
    protocol = timed_h11_protocol(request_read_timeout)
    logging.basicConfig(level=getattr(logging, log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sock = _listen(host, port)
    # until uvicorn takes SIGTERM over, it ends startup through `finally` (workers stopped)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    engine: Optional[Engine] = None
    server: Optional[_Server] = None
    failed: list[str] = []

    def on_death(why: str) -> None:
        failed.append(why)
        if server is not None:
            server.should_exit = True

    def on_drained() -> None:
        if server is not None:
            server.should_exit = True

    try:
        # the server answers /health (503, starting) while the ranks load and warm up
        engine = Engine(in_process=False, wait=False, **dataclasses.asdict(cfg))
        app = build_app(engine, served_model_name=served_model_name, max_queue=max_queue,
                        on_engine_death=on_death, api_key=api_key,
                        allowed_origins=allowed_origins, max_request_bytes=max_request_bytes,
                        drain_timeout=drain_timeout, on_drained=on_drained,
                        request_read_timeout=request_read_timeout,
                        tool_call_parser=tool_call_parser, reasoning_parser=reasoning_parser,
                        chat_template=read_chat_template(chat_template))
        # the app drains first (drain_when_asked); uvicorn's own wait is only a backstop
        config = uvicorn.Config(app, log_level=log_level, access_log=False, lifespan="on",
                                timeout_graceful_shutdown=DRAIN_GRACE_S, http=protocol)
        server = _Server(config, app.state.server)
        log.info("rank processes (pids, by rank): %s", engine.rank_pids)
        bound = sock.getsockname()
        shown = f"[{bound[0]}]" if sock.family == socket.AF_INET6 else bound[0]
        print(f"moeserve: serving {served_model_name or cfg.model} on "
              f"http://{shown}:{bound[1]} (/health answers 503 until the engine is ready)",
              flush=True)
        server.run(sockets=[sock])
    finally:
        if engine is not None:
            engine.shutdown()
        sock.close()
    if failed:
        print(f"moeserve: error: the engine failed: {failed[0]}", flush=True)
        return 1
    print("moeserve: drained and stopped", flush=True)
    return 0


def read_chat_template(path: Optional[str]) -> Optional[str]:
    """--chat-template: a jinja2 file; a ValueError (one line from the CLI) when it cannot be
    read or compiled."""
    if path is None:
        return None
    from jinja2.exceptions import TemplateError

    from moeserve.runtime.tokenizer import compile_chat_template

    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        compile_chat_template(text)
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--chat-template {path}: cannot be read ({exc})") from None
    except TemplateError as exc:
        raise ValueError(f"--chat-template {path}: not a jinja2 template ({exc})") from None
    return text


def _exit_on_sigterm(sig: int, frame: Any) -> None:
    raise SystemExit(128 + sig)
