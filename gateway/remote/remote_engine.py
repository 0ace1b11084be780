"""A `loragate engine` elsewhere, as the gateway's EngineClient: the same loop client as the
engine process beside it (engine.frontend.loop_client), over one WebSocket instead of a pipe.

A reader thread holds the connection, as the engine process's supervisor holds its pipe: it
hands each step's updates to asyncio (`EngineClient._deliver`), keeps the engine's last state
(what routing reads), and when the connection drops it fails every open request at once
(EngineDead: a 503, never a hang) and reconnects with back-off. Keepalive pings find an engine
that stopped answering without closing (a machine gone) within PING_INTERVAL + PING_TIMEOUT.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from typing import Any

from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidURI
from websockets.sync.client import ClientConnection, connect

from engine.config import EngineConfig
from engine.errors import EngineDead
from engine.frontend.facts import EngineFacts
from engine.frontend.grammar_asks import GrammarAsks
from engine.frontend.loop_client import LoopClient
from engine.messages import Abort, EngineRequest, EngineStats, Inbound, LoadLoRA, UnloadLoRA
from engine.request import GuidedSpec
from gateway.engine_service.server import ENGINE_ROUTE
from gateway.remote.wire import (
    WireError,
    decode_error,
    decode_stats,
    decode_update,
    encode_request,
    encode_spec,
)

logger = logging.getLogger(__name__)

PING_INTERVAL, PING_TIMEOUT = 0.5, 1.0
CONNECT_TIMEOUT = 5.0
RECONNECT_DELAY_MIN, RECONNECT_DELAY_MAX = 0.25, 5.0
MAX_MESSAGE_BYTES = 64 << 20


def engine_socket_url(url: str) -> str:
    """http://host:port → ws://host:port/internal/v1/engine (https → wss)."""
    base = url.rstrip("/")
    for plain, socket in (("https://", "wss://"), ("http://", "ws://")):
        if base.startswith(plain):
            base = socket + base.removeprefix(plain)
    if not base.startswith(("ws://", "wss://")):
        raise ValueError(f"an engine URL is http(s)://host:port, not {url!r}")
    return base if base.endswith(ENGINE_ROUTE) else base + ENGINE_ROUTE


class RemoteEngine(LoopClient):
    def __init__(
        self,
        url: str,
        config: EngineConfig,
        *,
        facts: EngineFacts,
        token: str | None = None,
        max_waiting: int = 1024,
    ) -> None:
        """`facts`: the model's as this gateway read them; an engine whose vocabulary differs
        serves another model and is refused when it says hello."""
        super().__init__(max_waiting, config.max_num_seqs)
        self.url = url
        self._socket_url = engine_socket_url(url)
        self._headers = {} if token is None else {"Authorization": f"Bearer {token}"}
        self._facts = facts
        self._asks = GrammarAsks(config.guided_compile_timeout)
        self._socket: ClientConnection | None = None
        self._send_lock = threading.Lock()
        self._connected = threading.Event()
        self._thread: threading.Thread | None = None
        self._stats = EngineStats()
        self._engine_health = "ok"
        self.state_at = 0.0  # time.monotonic() of the last state the engine sent
        self.hello: dict[str, Any] = {}

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self, wait: float = CONNECT_TIMEOUT) -> None:
        """Connect in the background; wait up to `wait` seconds for the first connection (an
        engine not up yet is retried, its replica out of rotation until it answers)."""
        self._thread = threading.Thread(
            target=self._hold, name=f"engine-link {self.url}", daemon=True
        )
        self._thread.start()
        self._connected.wait(wait)

    @property
    def is_alive(self) -> bool:
        return self._socket is not None and not self._stopping.is_set()

    @property
    def health(self) -> str:
        if self._stopping.is_set():
            return "stopping"
        # Connected: the engine's own word (its loop may be restarting behind the socket).
        return self._engine_health if self._socket is not None else "restarting"

    async def shutdown(self, grace_period: float = 10.0) -> None:
        await self._drain_pending(grace_period)
        socket = self._socket
        if socket is not None:
            socket.close()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 2.0)

    # -- what the gateway reads --------------------------------------------------------------

    async def compile_grammar(self, spec: GuidedSpec) -> None:
        """Asked of the engine over the socket (one round trip): compiled there, once, and the
        request sent after it on the same socket finds it compiled. Unlinked, there is no engine
        to ask: the pool holds or refuses the request, and the engine that takes it compiles
        its grammar before running it (gateway.engine_service), refusing one that cannot."""
        if self._socket is None:
            return
        try:
            await self._asks.ask(
                lambda ticket: self._send_text(json.dumps({"compile": [ticket, encode_spec(spec)]}))
            )
        except (ConnectionError, ConnectionClosed, OSError):
            return  # the link dropped as it was asked: as unlinked

    def stats(self) -> EngineStats:
        return self._stats

    # -- the socket ------------------------------------------------------------------------------

    def _submit(self, message: Inbound) -> None:
        if isinstance(message, EngineRequest):
            data: dict[str, Any] = {"request": encode_request(message)}
        elif isinstance(message, Abort):
            data = {"abort": message.request_id}
        elif isinstance(message, UnloadLoRA):
            data = {"unload": message.adapter_id}
        elif isinstance(message, LoadLoRA):
            return  # an engine loads what its requests name; the gateway does not steer slots
        try:
            self._send_text(json.dumps(data))
        except (ConnectionError, ConnectionClosed, OSError):
            if isinstance(message, EngineRequest):
                self._refuse(message.request_id, EngineDead(f"the engine at {self.url} is away"))

    def _send_text(self, text: str) -> None:
        with self._send_lock:
            if self._socket is None:
                raise ConnectionError("not connected")
            self._socket.send(text)

    def _hold(self) -> None:
        """Connect, read until the connection drops, fail what was open, reconnect."""
        delay = RECONNECT_DELAY_MIN
        down_logged = False
        while not self._stopping.is_set():
            try:
                with self._connect() as socket:
                    self._greet(socket)
                    logger.info("connected to engine %s (%s)", self.url, self.hello["model"])
                    delay, down_logged = RECONNECT_DELAY_MIN, False
                    self._read(socket)
            except (
                OSError,
                TimeoutError,
                InvalidHandshake,
                InvalidURI,
                ConnectionClosed,
                WireError,
            ) as exc:
                if not down_logged:
                    logger.warning("engine %s unreachable (%s); retrying", self.url, exc)
                    down_logged = True
                if self._stopping.wait(delay):
                    return
                delay = min(2 * delay, RECONNECT_DELAY_MAX)
                continue
            with self._send_lock:
                self._socket = None
            self._connected.clear()
            # Compiles asked of it go unanswered: as unlinked (see compile_grammar).
            self._asks.answer_all(None)
            if self._stopping.is_set():
                self._refuse_all(EngineDead("the server is shutting down"))
                return
            logger.error("engine %s went away; its requests failed", self.url)
            self._refuse_all(EngineDead(f"the engine at {self.url} went away; request lost"))

    def _connect(self) -> Any:
        return connect(
            self._socket_url,
            additional_headers=self._headers,
            compression=None,  # deflate costs more than it saves between machines of one site
            proxy=None,
            open_timeout=CONNECT_TIMEOUT,
            ping_interval=PING_INTERVAL,
            ping_timeout=PING_TIMEOUT,
            max_size=MAX_MESSAGE_BYTES,
        )

    def _greet(self, socket: ClientConnection) -> None:
        """The engine's hello, checked; then the socket is open to requests."""
        try:
            hello = json.loads(socket.recv(timeout=CONNECT_TIMEOUT))["hello"]
            self._check(hello)
        except (KeyError, TypeError, ValueError, TimeoutError, ConnectionClosed) as exc:
            raise WireError(f"no hello from the engine: {exc}") from exc
        self.hello = hello
        self.max_num_seqs = int(hello["max_num_seqs"])
        with self._send_lock:
            self._socket = socket
        self._connected.set()

    def _check(self, hello: dict[str, Any]) -> None:
        """The engine must serve the model the gateway tokenizes for."""
        facts = self.facts
        if int(hello["vocab_size"]) != facts.vocab_size:
            raise WireError(
                f"the engine's model has a vocabulary of {hello['vocab_size']} tokens, the "
                f"gateway's {facts.vocab_size}: another model"
            )
        if int(hello["max_model_len"]) < facts.max_model_len:
            logger.warning(
                "engine %s takes %s tokens per sequence, the gateway checks against %s",
                self.url,
                hello["max_model_len"],
                facts.max_model_len,
            )

    def _read(self, socket: ClientConnection) -> None:
        try:
            for raw in socket:
                message = json.loads(raw)
                step = message.get("step")
                if step is not None:
                    updates, finished = step
                    self._deliver([decode_update(u) for u in updates], finished)
                for request_id, kind, text in message.get("refused", ()):
                    self._refuse(request_id, decode_error([kind, text]))
                for ticket, error in message.get("compiled", ()):
                    self._asks.answer(int(ticket), None if error is None else decode_error(error))
                state = message.get("state")
                if state is not None:
                    self._engine_health = str(state.pop("health", "ok"))
                    self._stats = decode_stats(state)
                    self.state_at = time.monotonic()
        except (ConnectionClosed, OSError, ValueError, WireError) as exc:
            logger.debug("engine link %s closed: %s", self.url, exc)
