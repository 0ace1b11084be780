"""GrammarAsks: a grammar compile asked across a pipe or a socket, answered from the thread that
reads the engine's messages (engine/frontend/grammar_asks.py)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from engine.errors import EngineDead, GuidedSpecError
from engine.frontend.grammar_asks import GrammarAsks


async def test_an_answer_from_another_thread_ends_the_wait() -> None:
    asks = GrammarAsks(timeout=5.0)
    sent: list[int] = []

    def send(ticket: int) -> None:
        sent.append(ticket)
        threading.Timer(0.01, asks.answer, (ticket, None)).start()

    await asks.ask(send)
    await asks.ask(send)
    assert sent == [0, 1]  # a ticket per ask


async def test_the_engines_refusal_is_raised() -> None:
    asks = GrammarAsks(timeout=5.0)
    refusal = GuidedSpecError("cannot compile the regex: bad")
    with pytest.raises(GuidedSpecError, match="cannot compile the regex"):
        await asks.ask(lambda ticket: asks.answer(ticket, refusal))


async def test_no_answer_in_time_is_the_compile_timeouts_refusal_and_a_late_one_is_ignored() -> (
    None
):
    asks = GrammarAsks(timeout=0.05)
    tickets: list[int] = []
    with pytest.raises(GuidedSpecError, match="did not compile within 0.05 s"):
        await asks.ask(tickets.append)
    asks.answer(tickets[0], None)  # the engine's answer, too late: nobody waits
    await asyncio.sleep(0)


async def test_an_engine_gone_answers_every_ask_waiting() -> None:
    asks = GrammarAsks(timeout=5.0)
    waiting = [asyncio.create_task(asks.ask(lambda ticket: None)) for _ in range(3)]
    await asyncio.sleep(0)
    asks.answer_all(EngineDead("the engine process exited"))
    for task in waiting:
        with pytest.raises(EngineDead):
            await task


async def test_a_send_that_fails_raises_and_leaves_nothing_waiting() -> None:
    asks = GrammarAsks(timeout=5.0)

    def broken(ticket: int) -> None:
        raise EngineDead("the engine process exited")

    with pytest.raises(EngineDead):
        await asks.ask(broken)
    assert not asks._waiting
