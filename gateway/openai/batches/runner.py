"""The batch runner: each gateway runs batches' lines in the capacity interactive traffic leaves,
durably and exactly once, and finalizes the batches that are due.

    loop:   finalize what is due (tenants.batches: completed, expired, cancelled)
            claim up to max_concurrency - running lines (tenants.batch_lines: a lease each,
            tenants in turn), one task per line (gateway.openai.batches.lines), woken as
            lines finish, batches are made or cancelled here, else every POLL_INTERVAL
    beat:   every lease / 3 the leases of this gateway's lines renewed; a line that is no
            longer its own (taken over after a stall, its batch cancelled or expired) is
            aborted in the engine; a claim without a task (its write failed) given back
    a line: its answer written with its usage row in one transaction while the claim holds,
            or, if it could not run now, given back for later (after a short pause)

A gateway stopped in order aborts its lines and gives their claims back at once; one that
dies leaves them to lapse, and any gateway on the database (itself, restarted) claims them
after the lease. Nothing is answered or billed twice: a claim that lapsed and was taken over
writes nothing. A line whose claim lapsed MAX_ATTEMPTS times without an answer (one that
kills its gateway, say) fails instead of running again; a claim given back is not counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import time
from dataclasses import dataclass

from gateway.http.errors import APIError
from gateway.openai.batches.finalize import Finisher
from gateway.openai.batches.lines import LineRunner, Retry, refused, request_id
from gateway.openai.batches.writer import LineWriter
from gateway.tenancy.auth import RequestTenant, request_tenant
from tenants.batch_lines import ClaimedLine, LineAnswer, LineClaims, LineKey
from tenants.db import Database
from tenants.models import TENANT_ACTIVE, Tenant

logger = logging.getLogger(__name__)

POLL_INTERVAL = 1.0  # seconds between looks for batches made or due elsewhere
RETRY_PAUSE = 1.0  # seconds without new claims after a line could not run
MAX_ATTEMPTS = 5


@dataclass(frozen=True, slots=True)
class RunnerOptions:
    max_concurrency: int = 64  # lines in the engines at once, this gateway
    lease: float = 60.0  # seconds a claim lasts unless renewed
    priority: int = 100  # the engine band the lines run in (lower runs first)
    poll_interval: float = POLL_INTERVAL


def worker_id() -> str:
    """This runner's name on its claims: unique per process start."""
    return f"{socket.gethostname()[:32]}-{os.getpid()}-{secrets.token_hex(4)}"


class TenantLookup:
    """The tenant a batch runs as, read from its row as authentication would (its salt,
    weight, quota, models), cached for `ttl` seconds: a suspension reaches the runner in it."""

    def __init__(self, db: Database, secret_key: bytes, ttl: float) -> None:
        self.db = db
        self.secret_key = secret_key
        self.ttl = ttl
        self._cache: dict[tuple[str, str | None], tuple[float, RequestTenant | APIError]] = {}

    async def get(self, tenant_id: str, key_id: str | None) -> RequestTenant | APIError:
        now = time.monotonic()
        cached = self._cache.get((tenant_id, key_id))
        if cached is not None and cached[0] > now:
            return cached[1]
        async with self.db.session() as session:
            tenant = await session.get(Tenant, tenant_id)
        found: RequestTenant | APIError
        if tenant is None:
            found = APIError(404, "the batch's tenant no longer exists", code="not_found")
        elif tenant.status != TENANT_ACTIVE:
            found = APIError(
                403, "This account is suspended.", type="permission_error", code="tenant_suspended"
            )
        else:
            found = request_tenant(self.secret_key, tenant, key_id)
        if len(self._cache) > 10_000:
            self._cache.clear()
        self._cache[(tenant_id, key_id)] = (now + self.ttl, found)
        return found


class BatchRunner:
    def __init__(
        self,
        claims: LineClaims,
        finisher: Finisher,
        lines: LineRunner,
        tenants: TenantLookup,
        options: RunnerOptions,
    ) -> None:
        self.claims = claims
        self.finisher = finisher
        self.lines = lines
        self.tenants = tenants
        self.options = options
        self.worker = finisher.finisher
        self.writer = LineWriter(claims, self.worker)
        self.num_answered = 0  # lines this runner wrote (done or failed)
        self.num_lost = 0  # answers not written: the claim was gone
        self._running: dict[LineKey, asyncio.Task[None]] = {}
        # Those of them answered, their writes under way: out of the engine, so their places
        # are claimed again without waiting for the write.
        self._answered: set[LineKey] = set()
        self._wake = asyncio.Event()
        self._lock = asyncio.Lock()  # a claim and its tasks, against the beat's comparison
        self._loop_task: asyncio.Task[None] | None = None
        self._beat_task: asyncio.Task[None] | None = None
        self._paused_until = 0.0
        self._last_tenant: str | None = None
        # Batches are finalized once a poll interval, or at once when one is made or
        # cancelled here, or when no line runs here (a batch may have just finished).
        self._finalize_now = True
        self._finalized_at = 0.0

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_in_engine(self) -> int:
        """Lines claimed and not yet answered."""
        return len(self._running) - len(self._answered)

    async def start(self) -> None:
        """Start claiming and finalizing, in the event loop that serves."""
        if self._loop_task is not None:
            return
        self._wake = asyncio.Event()
        self._lock = asyncio.Lock()
        self._loop_task = asyncio.create_task(self._run(), name="batch-runner")
        self._beat_task = asyncio.create_task(self._beat(), name="batch-leases")

    def wake(self) -> None:
        """Look for work now (a batch made or cancelled here)."""
        self._finalize_now = True
        self._wake.set()

    async def close(self) -> None:
        """Stop: the lines running here aborted in the engine and their claims given back
        for any gateway to take at once."""
        for task in (self._loop_task, self._beat_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._loop_task = self._beat_task = None
        keys = list(self._running)
        tasks = list(self._running.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        await self.writer.close()
        try:
            released = await self.claims.release(self.worker, keys)
        except Exception:  # noqa: BLE001 - their leases lapse instead
            logger.exception("could not give back %d batch lines", len(keys))
            return
        if released:
            logger.info("gave back %d batch lines for another gateway to run", released)

    # -- the loop -----------------------------------------------------------------------------

    async def _run(self) -> None:
        failing = False
        while True:
            self._wake.clear()
            try:
                await self._finalize()
                await self._claim()
                failing = False
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the database, say: the next round tries again
                if not failing:
                    logger.exception("the batch runner failed a round; it tries again")
                failing = True
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.options.poll_interval)

    async def _finalize(self) -> None:
        now = time.monotonic()
        if not (
            self._finalize_now
            or not self._running
            or now - self._finalized_at >= self.options.poll_interval
        ):
            return
        self._finalize_now, self._finalized_at = False, now
        for ended in await self.finisher.finish_due():
            if ended.ending != "completed":
                self._abort(ended.id)

    async def _claim(self) -> None:
        """Claim lines to fill the free places, a quarter of them at a time (one transaction
        for many lines, the engine never short of them) or whatever is free once none runs."""
        free = self.options.max_concurrency - self.num_in_engine
        refill = max(1, self.options.max_concurrency // 4)
        if (free < refill and self.num_in_engine) or time.monotonic() < self._paused_until:
            return
        async with self._lock:
            claimed = await self.claims.claim(
                self.worker, free, self.options.lease, self._last_tenant
            )
            for line in claimed:
                task = asyncio.create_task(self._line(line), name=request_id(*line.key))
                self._running[line.key] = task
        if claimed:
            self._last_tenant = claimed[-1].tenant_id

    def _abort(self, batch_id: str) -> None:
        """The batch's lines that run here, aborted (it was cancelled or expired)."""
        for (running_batch, _), task in list(self._running.items()):
            if running_batch == batch_id:
                task.cancel()

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self.options.lease / 3)
            try:
                async with self._lock:
                    mine = await self.claims.renew(self.worker, self.options.lease)
                    local = set(self._running)
                    lost = [self._running[key] for key in local - mine]
                for task in lost:
                    task.cancel()
                if lost:
                    logger.info("%d batch lines are no longer this gateway's: aborted", len(lost))
                if stray := list(mine - local):
                    await self.claims.release(self.worker, stray)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the next beat tries again, within the lease
                logger.exception("could not renew the leases of this gateway's batch lines")

    # -- a line ---------------------------------------------------------------------------------

    async def _line(self, line: ClaimedLine) -> None:
        try:
            answer = await self._answer(line)
            if isinstance(answer, Retry):
                logger.info("batch line %s runs later: %s", request_id(*line.key), answer.reason)
                self._paused_until = time.monotonic() + RETRY_PAUSE
                await self.claims.release(self.worker, [line.key])
                return
            self._answered.add(line.key)
            self._wake.set()  # its place in the engine is free
            await self._write(line, answer)
        except asyncio.CancelledError:
            raise  # aborted: its claim is gone, or the gateway stops (and gives it back)
        except Exception:  # noqa: BLE001 - its lease lapses and it runs again
            logger.exception("batch line %s failed in the runner", request_id(*line.key))
        finally:
            self._running.pop(line.key, None)
            self._answered.discard(line.key)
            self._wake.set()

    async def _answer(self, line: ClaimedLine) -> LineAnswer | Retry:
        if line.attempts > MAX_ATTEMPTS:
            return refused(
                line,
                APIError(
                    500,
                    f"this line was started {line.attempts - 1} times and never finished",
                    type="server_error",
                ),
            )
        tenant = await self.tenants.get(line.tenant_id, line.key_id)
        if isinstance(tenant, APIError):
            return refused(line, tenant)
        return await self.lines.run(line, tenant)

    async def _write(self, line: ClaimedLine, answer: LineAnswer) -> None:
        """The answer and its usage row, once, while the claim holds, with the lines that
        finished beside it (batches.writer); a database that fails is tried again a few times
        (the line's lease is renewed meanwhile)."""
        if await self.writer.write(line.key, answer):
            self.num_answered += 1
        else:
            self.num_lost += 1
            logger.info("batch line %s was no longer this gateway's", request_id(*line.key))
