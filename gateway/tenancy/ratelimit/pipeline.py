"""Coalesces the scripts concurrent tasks run into one pipeline round trip.

A round trip to Redis costs a write and a read syscall on each side; under load that, not
the script, bounds a process's checks per second. The scripts that tasks issue in one turn
of the event loop go out as one pipeline (one write, one read of all the replies), so 64
concurrent requests cost one round trip, not 64 on 64 connections. Each script still runs
alone and atomically in Redis; a lone request goes out at once, one loop turn later.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from redis.asyncio import Redis
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError

_Call = tuple[AsyncScript, Sequence[Any], Sequence[Any], "asyncio.Future[Any]"]


class AutoPipeline:
    def __init__(self, redis: Redis) -> None:
        self.redis = redis
        self._pending: list[_Call] = []
        self._sending: set[asyncio.Task[None]] = set()
        self.num_round_trips = 0

    async def run(self, script: AsyncScript, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        """The script's reply, or the error it or the connection raised."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._pending.append((script, keys, args, future))
        if len(self._pending) == 1:
            # Flush after every task already woken this turn has added its call.
            loop.call_soon(self._flush)
        return await future

    def _flush(self) -> None:
        # A caller cancelled before its script went out (a client that hung up) sends
        # nothing: an acquire that nobody will release would hold its slot for a lease.
        batch = [call for call in self._pending if not call[3].done()]
        self._pending = []
        if not batch:
            return
        # A task of its own: a cancelled caller must not strand the others' replies.
        task = asyncio.ensure_future(self._send(batch))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _send(self, batch: list[_Call]) -> None:
        try:
            replies = await self._execute(batch)
        except asyncio.CancelledError:
            for *_, future in batch:
                future.cancel()
            raise
        except Exception as exc:  # noqa: BLE001 - every caller gets the failure
            for *_, future in batch:
                if not future.done():
                    future.set_exception(exc)
            return
        for (*_, future), reply in zip(batch, replies, strict=True):
            if future.done():  # its caller was cancelled
                continue
            if isinstance(reply, Exception):
                future.set_exception(reply)
            else:
                future.set_result(reply)

    async def _execute(self, batch: list[_Call]) -> list[Any]:
        self.num_round_trips += 1
        if len(batch) == 1:  # EVALSHA, loading the script if Redis lost it
            script, keys, args, _ = batch[0]
            return [await script(keys=keys, args=args)]
        pipe = self.redis.pipeline(transaction=False)
        for script, keys, args, _ in batch:
            pipe.evalsha(script.sha, len(keys), *keys, *args)
        replies: list[Any] = await pipe.execute(raise_on_error=False)
        # After a Redis restart (or SCRIPT FLUSH) the scripts are gone: the ones refused
        # run again one by one, which loads them (a script that did not run changed nothing).
        for i, reply in enumerate(replies):
            if isinstance(reply, NoScriptError):
                script, keys, args, _ = batch[i]
                try:
                    replies[i] = await script(keys=keys, args=args)
                except Exception as exc:  # noqa: BLE001 - this caller's failure
                    replies[i] = exc
        return replies
