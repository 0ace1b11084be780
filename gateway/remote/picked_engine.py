"""Engines behind one address that picks among them per request: an inference gateway whose
endpoint picker (the Gateway API Inference Extension's) chooses a `loragate engine` pod for each
request from the pods' own metrics. A models-file entry says so with `routing: picker` and
that one address in `urls`.

Each request is one POST (gateway.remote.picker_wire), so the picker sees every one; this
gateway neither links to the engines nor routes among them, and knows of them only what their
answers say. When the address answers that no engine is ready (502, 503, 504: the pool is at
zero, or its pods are not ready yet) or cannot be reached, a request that has not started is
held and sent again, as a model starting on demand holds its requests: at most `max_pending`
at once, each for at most `timeout` seconds, then a 503 with Retry-After. Held requests count
in `loragate:model_pending_requests`, the signal that scales the pool from zero. A stream that
breaks after its first update ends with the 503 of an engine gone (EngineDead), and its usage
row holds what it produced.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncGenerator
from typing import Any

import httpx

from engine.errors import EngineDead, EngineOverloaded, RequestRefused, StepFailed
from engine.frontend.client import EngineClient, Scaling
from engine.frontend.facts import EngineFacts
from engine.messages import EngineRequest, EngineStats
from engine.outputs import SequenceUpdate
from engine.request import GuidedSpec
from gateway.models.replica_pool import HoldPolicy
from gateway.remote.picker_wire import (
    DONE,
    GENERATE_ROUTE,
    KEEPALIVE_INTERVAL,
    parse_event,
    request_body,
    split_events,
)
from gateway.remote.wire import WireError, decode_error, decode_update

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT = 5.0
# An engine sends a keepalive every KEEPALIVE_INTERVAL seconds: this long without a byte, it
# (or the path to it) is gone.
SILENCE_TIMEOUT = 5 * KEEPALIVE_INTERVAL
RETRY_DELAY_MIN, RETRY_DELAY_MAX = 0.1, 2.0
# What the address answers while no engine can take a request: a gateway without a ready
# endpoint (502 from Envoy or nginx, 503 from the picker or an engine not ok, 504).
NO_ENGINE = frozenset({502, 503, 504})
DONE_EVENT = DONE.rstrip()


class _NotTaken(Exception):
    """No engine took the request (it produced nothing): sending it again is safe."""


class PickedEngine(EngineClient):
    """A model's engines behind one address, as the gateway's EngineClient."""

    def __init__(
        self,
        name: str,
        url: str,
        *,
        facts: EngineFacts,
        hold: HoldPolicy,
        token: str | None = None,
    ) -> None:
        self.name = name
        self.url = url.rstrip("/")
        self.hold = hold
        self._facts = facts
        self._headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        if token is not None:
            self._headers["Authorization"] = f"Bearer {token}"
        self._client: httpx.AsyncClient | None = None
        self._waiting = 0  # sent, no update yet (in the picker's queue or an engine's)
        self._running = 0
        self.num_held = 0  # held while no engine is ready
        self._down_since: float | None = None  # the last answer said no engine is ready
        self._stopping = False

    # -- what the gateway reads --------------------------------------------------------------

    @property
    def facts(self) -> EngineFacts:
        return self._facts

    @property
    def health(self) -> str:
        if self._stopping:
            return "stopping"
        if self._down_since is None or self.hold.scale_to_zero:
            return "ok"  # at zero by design: the next request wakes the pool
        return "restarting"

    def scaling(self) -> Scaling:
        """One engine ready while the address answers with an engine, none while it answers
        none (the engines behind it are the picker's to count); the requests held meanwhile."""
        return Scaling(int(self._down_since is None), 0, self.num_held)

    def stats(self) -> EngineStats:
        """This gateway's requests there; the engines' own state is on their /metrics."""
        return EngineStats(num_running=self._running, num_waiting=self._waiting)

    async def compile_grammar(self, spec: GuidedSpec) -> None:
        """Nothing to ask yet: which engine runs the request is the picker's choice, made as the
        request is sent (and the picker routes only its one route). That engine compiles the
        grammar before running the request and refuses one that cannot compile: a
        GuidedSpecError in place of the first update, still a 400 before anything streams."""

    def unload_lora(self, adapter_id: str) -> None:
        """The engines behind the address are not this gateway's to steer: a deleted
        adapter leaves their slots as they need the room (their LRU)."""

    async def shutdown(self, grace_period: float = 10.0) -> None:
        self._stopping = True
        deadline = time.monotonic() + grace_period
        while self._waiting + self._running + self.num_held and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self._client is not None:
            await self._client.aclose()

    # -- requests ------------------------------------------------------------------------------

    async def generate(self, request: EngineRequest) -> AsyncGenerator[SequenceUpdate]:
        if self._stopping:
            raise EngineDead("the server is shutting down")
        body = request_body(request, self.name, self._facts.tokenizer)
        held_until: float | None = None
        delay = RETRY_DELAY_MIN
        try:
            while True:
                try:
                    async for update in self._send(body):
                        if held_until is not None:
                            held_until, self.num_held = None, self.num_held - 1
                        yield update
                    return
                except _NotTaken as exc:
                    if self._down_since is None:
                        logger.warning("%s: no engine took a request (%s); holding", self.url, exc)
                        self._down_since = time.monotonic()
                    held_until = self._hold(held_until, exc)
                await asyncio.sleep(min(delay, max(0.0, held_until - time.monotonic())))
                delay = min(2 * delay, RETRY_DELAY_MAX)
        finally:
            if held_until is not None:
                self.num_held -= 1

    def _hold(self, held_until: float | None, reason: Exception) -> float:
        """When a request not taken may be sent again; raises the 503 past the bounds."""
        if held_until is None:
            if self.num_held >= self.hold.max_pending:
                raise EngineOverloaded(
                    f"no engine of {self.name!r} is ready and {self.num_held} requests wait for one"
                )
            self.num_held += 1
            return time.monotonic() + self.hold.timeout
        if time.monotonic() >= held_until:
            raise EngineOverloaded(
                f"no engine of {self.name!r} took the request within {self.hold.timeout:g} s "
                f"({reason})"
            )
        return held_until

    async def _send(self, body: bytes) -> AsyncGenerator[SequenceUpdate]:
        """One POST's updates. Raises _NotTaken where no engine took it, EngineDead where
        its stream broke after an update, and the engine's refusal as its own type."""
        started = False
        self._waiting += 1
        try:
            async with self._http().stream(
                "POST", self.url + GENERATE_ROUTE, content=body, headers=self._headers
            ) as response:
                if response.status_code != 200:
                    raise await _refusal(response, self.url)
                self._down_since = None
                # Raw bytes split here: httpx's text and line decoding cost more than the
                # rest of a token's way through this gateway.
                chunks, pending = response.aiter_raw(), b""
                while True:
                    async with asyncio.timeout(SILENCE_TIMEOUT):
                        chunk = await anext(chunks, None)
                    if chunk is None:
                        raise _NotTaken("the stream ended before [DONE]")
                    events, pending = split_events(pending + chunk)
                    for raw in events:
                        if raw == DONE_EVENT:
                            return
                        kind, value = _decoded(raw)
                        if kind == "error":
                            raise value  # the engine's refusal, as its own type
                        if kind == "update":
                            if not started:
                                started = True
                                self._waiting -= 1
                                self._running += 1
                            yield value
        except (httpx.TransportError, TimeoutError, _NotTaken, WireError) as exc:
            what = str(exc) or type(exc).__name__
            if started:
                raise EngineDead(f"the engine behind {self.url} went away: {what}") from exc
            raise _NotTaken(what) from exc
        finally:
            if started:
                self._running -= 1
            else:
                self._waiting -= 1

    def _http(self) -> httpx.AsyncClient:
        # Made on first use, on the serving loop; one connection per stream under way.
        if self._client is None:
            self._client = httpx.AsyncClient(
                timeout=httpx.Timeout(connect=CONNECT_TIMEOUT, read=None, write=30.0, pool=None),
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
                trust_env=False,  # no proxy from the environment between gateway and engines
            )
        return self._client


async def _refusal(response: httpx.Response, url: str) -> Exception:
    """The exception an answer other than 200 raises."""
    status = response.status_code
    if status in NO_ENGINE:
        return _NotTaken(f"{url} answered {status}")
    text = (await response.aread()).decode(errors="replace")
    try:
        message = str(json.loads(text)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        message = text[:200] or f"status {status}"
    if status == 400:
        return RequestRefused(message)
    if status == 429:
        return EngineOverloaded(message)
    if status in (401, 403):
        return EngineDead(f"{url} refused the engine token: {message}")
    if status == 404:
        return EngineDead(f"{url} is not a loragate engine ({GENERATE_ROUTE}: 404)")
    return StepFailed(f"{url} answered {status}: {message}")


def _decoded(raw: bytes) -> tuple[str | None, Any]:
    """("update", a SequenceUpdate) | ("error", the exception) | (None, None) for an event
    that carries neither. Raises WireError for one that does not decode."""
    try:
        data = parse_event(raw)
        if data is None:
            return None, None
        if "update" in data:
            return "update", decode_update(data["update"])
        if "error" in data:
            return "error", decode_error(data["error"])
        return None, None  # usage: the engine's count, for the picker; the gateway counts its own
    except (ValueError, KeyError, TypeError) as exc:
        raise WireError(f"an event that does not decode: {raw[:120]!r}") from exc
