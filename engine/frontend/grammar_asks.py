"""`GrammarAsks`: grammar compiles the gateway asks of an engine on the other side of a pipe or a
socket, each awaiting its answer. A grammar compiles once, in the engine's own cache: the ask
waits for that compile, and the request sent after it finds its grammar there.

An ask goes out under a ticket; the thread that reads the engine's messages answers it by that
ticket, and the asker's event loop is woken with the answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Callable

from engine.errors import GuidedSpecError
from engine.guided.matcher import timeout_message


class GrammarAsks:
    def __init__(self, timeout: float) -> None:
        """`timeout`: seconds an ask waits (the engine's guided_compile_timeout: a request
        would not wait longer for its grammar either)."""
        self.timeout = timeout
        self._waiting: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = {}
        self._tickets = itertools.count()

    async def ask(self, send: Callable[[int], None]) -> None:
        """`send(ticket)` puts the ask on the wire; then wait for its answer. Raises the
        GuidedSpecError the engine answered or that of the timeout, and whatever `send`
        raises."""
        loop = asyncio.get_running_loop()
        ticket = next(self._tickets)
        future: asyncio.Future[None] = loop.create_future()
        self._waiting[ticket] = (loop, future)
        try:
            send(ticket)
            await asyncio.wait_for(future, self.timeout)
        except TimeoutError:
            raise GuidedSpecError(timeout_message(self.timeout)) from None
        finally:
            self._waiting.pop(ticket, None)

    def answer(self, ticket: int, error: BaseException | None) -> None:
        """The engine's answer (None: compiled), from any thread; an ask no longer waiting
        (timed out, cancelled) is ignored."""
        waiting = self._waiting.pop(ticket, None)
        if waiting is not None:
            loop, future = waiting
            with contextlib.suppress(RuntimeError):  # its loop has closed: nobody waits
                loop.call_soon_threadsafe(_settle, future, error)

    def answer_all(self, error: BaseException | None) -> None:
        """Every ask waiting, answered at once (the engine is gone)."""
        for ticket in list(self._waiting):
            self.answer(ticket, error)


def _settle(future: asyncio.Future[None], error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
