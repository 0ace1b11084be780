"""`loragate engine`: one model's engine as a network service, for gateways to reach.

    loragate engine --model models/smollm2 --port 8100 [--engine-token T]

It runs the engine as `loragate serve` does (its own process, the same knobs) and serves:

- `/internal/v1/engine`: a WebSocket per gateway carrying engine requests in and each step's
  updates out (gateway.remote.wire): the gateway's `RemoteEngine` is a loop client over it.
- `/internal/v1/generate`: one request per POST, its updates streamed back as server-sent
  events (gateway.remote.picker_wire), for gateways behind an inference gateway that picks
  an engine per request (`routing: picker`).
- `/internal/v1/state`: what a router reads (running, waiting, KV usage, resident adapters).
- `/internal/v1/adapters/{sha256}`: PUT loads an adapter from the adapter store into a slot,
  DELETE unloads it. Adapters are named by content hash only.
- `/health` and `/metrics` (vLLM's engine series, label `model_name`).

Tenant context (cache salt, fairness key and weight, adapter) arrives only through the internal
routes, and they need the engine token: without it a caller could choose another tenant's salt
and read its prefix cache. With no token set the engine binds loopback only.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request, WebSocket, WebSocketDisconnect
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from adapters.store import AdapterStorage
from engine.errors import RequestRefused
from engine.frontend.client import EngineClient
from engine.frontend.loop_client import LoopClient
from engine.lora.types import LoRARequest
from engine.messages import EngineRequest
from engine.outputs import SequenceUpdate
from gateway.remote.picker_wire import (
    DONE,
    GENERATE_ROUTE,
    KEEPALIVE,
    KEEPALIVE_INTERVAL,
    event,
    read_body,
)
from gateway.remote.wire import (
    decode_request,
    decode_spec,
    encode_error,
    encode_stats,
    encode_update,
)

logger = logging.getLogger(__name__)

ENGINE_ROUTE = "/internal/v1/engine"
# How often a connected gateway hears the engine's state when it changes (routing reads it).
STATE_INTERVAL = 0.1
# WebSocket close code for a peer without the token (the HTTP routes answer 401).
CLOSE_UNAUTHORIZED = 4401


class EngineService:
    """The engine and what guards it."""

    def __init__(
        self,
        name: str,
        engine: LoopClient,
        *,
        store: AdapterStorage | None,
        token: str | None,
        block_size: int,
    ) -> None:
        self.name = name
        self.engine = engine
        self.store = store
        self._token = None if token is None else f"Bearer {token}".encode()
        self.block_size = block_size

    def authorized(self, header: str | None) -> bool:
        """True for the engine token's holder (anyone, where no token is set: loopback)."""
        if self._token is None:
            return True
        return header is not None and hmac.compare_digest(header.encode(), self._token)

    def hello(self) -> dict[str, Any]:
        """What a gateway learns when it connects."""
        engine, facts = self.engine, self.engine.facts
        return {
            "model": self.name,
            "max_model_len": facts.max_model_len,
            "vocab_size": facts.vocab_size,
            "eos_token_ids": list(facts.eos_token_ids),
            "max_num_seqs": engine.max_num_seqs,
            "block_size": self.block_size,
        }

    def state(self) -> dict[str, Any]:
        return encode_stats(self.engine.stats()) | {"health": self.engine.health}


class _Connection:
    """One gateway's WebSocket: its requests run as tasks whose updates gather in an outbox,
    sent as one message per wake-up (one per step while the engine is busy)."""

    def __init__(self, service: EngineService, websocket: WebSocket) -> None:
        self.service = service
        self.websocket = websocket
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.compiles: set[asyncio.Task[None]] = set()
        self.updates: list[list[Any]] = []
        self.finished: list[str] = []
        self.refused: list[list[Any]] = []
        self.compiled: list[list[Any]] = []
        self.wake = asyncio.Event()
        self.last_state: dict[str, Any] | None = None

    async def serve(self) -> None:
        await self.websocket.send_text(json.dumps({"hello": self.service.hello()}))
        sender = asyncio.create_task(self._send_loop())
        ticker = asyncio.create_task(self._tick())
        try:
            while True:
                self._receive(json.loads(await self.websocket.receive_text()))
        except (WebSocketDisconnect, json.JSONDecodeError, RuntimeError):
            pass
        finally:
            ticker.cancel()
            sender.cancel()
            for task in [*self.tasks.values(), *self.compiles]:
                task.cancel()  # a gateway that left: its requests are aborted

    def _receive(self, message: dict[str, Any]) -> None:
        if "request" in message:
            try:
                request = decode_request(message["request"], self.service.store)
            except RequestRefused as exc:
                self._refuse(str(message["request"].get("request_id", "")), exc)
                return
            self.tasks[request.request_id] = asyncio.create_task(self._run(request))
        elif "abort" in message:
            task = self.tasks.pop(str(message["abort"]), None)
            if task is not None:
                task.cancel()
        elif "unload" in message:
            self.service.engine.unload_lora(str(message["unload"]))
        elif "compile" in message:
            ticket, spec = message["compile"]
            task = asyncio.create_task(self._compile(ticket, spec))
            self.compiles.add(task)
            task.add_done_callback(self.compiles.discard)

    async def _compile(self, ticket: int, spec: dict[str, Any]) -> None:
        """A grammar compile the gateway asked (RemoteEngine.compile_grammar), answered."""
        try:
            await self.service.engine.compile_grammar(decode_spec(spec))
        except Exception as exc:  # noqa: BLE001 - the gateway raises it for its caller
            self.compiled.append([ticket, encode_error(exc)])
        else:
            self.compiled.append([ticket, None])
        self.wake.set()

    async def _run(self, request: EngineRequest) -> None:
        request_id = request.request_id
        try:
            await _grammar_compiled(self.service.engine, request)
            async for update in self.service.engine.generate(request):
                self.updates.append(encode_update(update))
                self.wake.set()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the gateway raises it for its caller
            self._refuse(request_id, exc)
        else:
            self.finished.append(request_id)
            self.wake.set()
        finally:
            self.tasks.pop(request_id, None)

    def _refuse(self, request_id: str, error: BaseException) -> None:
        self.refused.append([request_id, *encode_error(error)])
        self.wake.set()

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(STATE_INTERVAL)
            self.wake.set()

    async def _send_loop(self) -> None:
        last_state = 0.0
        while True:
            await self.wake.wait()
            self.wake.clear()
            message: dict[str, Any] = {}
            if self.updates or self.finished:
                message["step"] = [self.updates, self.finished]
                self.updates, self.finished = [], []
            if self.refused:
                message["refused"], self.refused = self.refused, []
            if self.compiled:
                message["compiled"], self.compiled = self.compiled, []
            now = time.monotonic()
            if now - last_state >= STATE_INTERVAL:
                state = self.service.state()
                if state != self.last_state:
                    message["state"] = self.last_state = state
                last_state = now
            if message:
                await self.websocket.send_text(json.dumps(message))


def _internal(request: Request) -> EngineService:
    service: EngineService = request.app.state.service
    if not service.authorized(request.headers.get("authorization")):
        raise Unauthorized
    return service


class Unauthorized(Exception):
    pass


def unauthorized() -> JSONResponse:
    return JSONResponse(
        {
            "error": {
                "message": "this route needs the engine token (Authorization: Bearer ...)",
                "type": "authentication_error",
                "param": None,
                "code": "invalid_engine_token",
            }
        },
        status_code=401,
        headers={"WWW-Authenticate": "Bearer"},
    )


router = APIRouter()


@router.websocket(ENGINE_ROUTE)
async def engine_socket(websocket: WebSocket) -> None:
    service: EngineService = websocket.app.state.service
    if not service.authorized(websocket.headers.get("authorization")):
        await websocket.close(CLOSE_UNAUTHORIZED, "this route needs the engine token")
        return
    await websocket.accept()
    await _Connection(service, websocket).serve()


@router.post(GENERATE_ROUTE)
async def generate(request: Request) -> Response:
    service = _internal(request)
    try:
        engine_request = read_body(await request.body(), service.store)
    except RequestRefused as exc:
        return _error(400, str(exc), "invalid_value")
    if service.engine.health != "ok":  # not started on: the caller may try another pod
        response = _error(503, f"the engine is {service.engine.health}", "service_unavailable")
        response.headers["Retry-After"] = "1"
        return response
    return StreamingResponse(
        _events(service.engine, engine_request),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


async def _grammar_compiled(engine: EngineClient, request: EngineRequest) -> None:
    """A guided request's grammar compiled before the request runs, so that one that cannot
    compile is refused (GuidedSpecError: a 400 at the gateway) rather than failed in a step. A
    gateway that asked already (RemoteEngine.compile_grammar) finds it compiled; one behind a
    picker asks nothing (PickedEngine) and relies on this."""
    if request.params.guided is not None:
        await engine.compile_grammar(request.params.guided)


async def _events(engine: EngineClient, request: EngineRequest) -> AsyncIterator[bytes]:
    """The request's updates as server-sent events, what is ready sent as one chunk; a
    keepalive in silences (queued, or a long prefill), so the gateway can tell a quiet engine
    from a vanished one. The client leaving cancels the pump, whose engine.generate aborts."""
    queue: asyncio.Queue[SequenceUpdate | BaseException | None] = asyncio.Queue()

    async def pump() -> None:
        try:
            await _grammar_compiled(engine, request)
            async for update in engine.generate(request):
                queue.put_nowait(update)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the gateway raises it for its caller
            queue.put_nowait(exc)
        else:
            queue.put_nowait(None)

    task = asyncio.create_task(pump())
    prompt_tokens = completion_tokens = 0
    try:
        while True:
            try:
                async with asyncio.timeout(KEEPALIVE_INTERVAL):  # no task per wait, as wait_for
                    items = [await queue.get()]
            except TimeoutError:
                yield KEEPALIVE
                continue
            while not queue.empty():
                items.append(queue.get_nowait())
            chunk: list[bytes] = []
            for item in items:
                if item is None:
                    usage = {
                        "prompt_tokens": prompt_tokens,
                        "completion_tokens": completion_tokens,
                        "total_tokens": prompt_tokens + completion_tokens,
                    }
                    yield b"".join([*chunk, event({"usage": usage}), DONE])
                    return
                if isinstance(item, BaseException):
                    yield b"".join([*chunk, event({"error": encode_error(item)})])
                    return
                prompt_tokens = item.num_prompt_tokens
                completion_tokens += len(item.new_token_ids)
                chunk.append(event({"update": encode_update(item)}))
            yield b"".join(chunk)
    finally:
        task.cancel()


@router.get("/internal/v1/state")
async def state(request: Request) -> JSONResponse:
    service = _internal(request)
    return JSONResponse({"hello": service.hello(), "state": service.state()})


@router.put("/internal/v1/adapters/{sha256}")
async def load_adapter(request: Request, sha256: str) -> JSONResponse:
    service = _internal(request)
    if service.store is None:
        return _error(400, "this engine serves no adapters (--enable-lora)", "lora_disabled")
    try:
        stored = service.store.contains(sha256)
    except ValueError:
        return _error(400, "an adapter is named by the sha256 of its files", "invalid_value")
    if not stored:
        return _error(404, f"adapter {sha256} is not in the adapter store", "adapter_not_found")
    service.engine.load_lora(LoRARequest(sha256[:12], str(service.store.path(sha256)), sha256))
    return JSONResponse({"adapter_id": sha256, "status": "loading"}, status_code=202)


@router.delete("/internal/v1/adapters/{sha256}")
async def unload_adapter(request: Request, sha256: str) -> JSONResponse:
    service = _internal(request)
    service.engine.unload_lora(sha256)
    return JSONResponse({"adapter_id": sha256, "status": "unloading"}, status_code=202)


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    status = request.app.state.service.engine.health
    return JSONResponse({"status": status}, status_code=200 if status == "ok" else 503)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(
        generate_latest(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST
    )


def _error(status: int, message: str, code: str) -> JSONResponse:
    kinds = {404: "not_found_error", 503: "service_unavailable"}
    kind = kinds.get(status, "invalid_request_error")
    body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    return JSONResponse(body, status_code=status)
