"""One batch line through the same core as its route: its body made a `Generation` as the route
makes it (gateway.openai.chat, .completions, or .responses without storing the response), in
the batch band (`priority`: settings.batch_priority) with endpoint `batch`, admitted by the
tenant's monthly quota alone (never its rpm, tpm or concurrency: Admission.admit_quota),
collected whole and answered with the body the route would answer. The same greedy request
answers the same here as interactively.

The usage row is not spooled to the ledger: `LineSink` keeps it (request id
`<batch_id>-<line>`, endpoint `batch`, the batch's id) for the runner to write with the
line's answer in one transaction (tenants.batch_lines). A line that could not run now (an
engine overloaded, restarting or stopping, the limiter down, an answer cut short) is a
`Retry`: nothing is written, and the line runs again later.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from engine.request import OutputKind
from gateway.http.errors import APIError, api_error, validation_param
from gateway.openai.answer import Answer
from gateway.openai.batch_lines import BODIES
from gateway.openai.chat import ChatServing
from gateway.openai.completions import CompletionServing
from gateway.openai.json_response import collect, json_body
from gateway.openai.protocol import ChatCompletionRequest, CompletionRequest
from gateway.openai.responses.protocol import ResponsesRequest
from gateway.openai.responses.serving import ResponsesServing
from gateway.openai.serving import BATCH_ENDPOINT, Generation, OpenAIServing
from gateway.tenancy.auth import RequestTenant
from tenants.batch_lines import ClaimedLine, LineAnswer
from tenants.ledger import UsageRecord

logger = logging.getLogger(__name__)

ENDPOINT = BATCH_ENDPOINT  # the usage rows' endpoint
# Statuses a retry may cure: the server's state, not the request.
RETRIED_STATUSES = (502, 503, 504)

# The answer collected, as the route's JSON body.
Render = Callable[[Answer], Awaitable[dict[str, Any]]]


@dataclass(frozen=True, slots=True)
class Retry:
    """The line could not run now; `reason` for the log."""

    reason: str


class LineSink:
    """A UsageSink that keeps a batch line's usage row, as the line's own, for the runner to
    write with its answer."""

    __slots__ = ("batch_id", "request_id", "row")

    def __init__(self, batch_id: str, request_id: str) -> None:
        self.batch_id = batch_id
        self.request_id = request_id
        self.row: UsageRecord | None = None

    async def record(self, record: UsageRecord) -> None:
        self.record_nowait(record)

    def record_nowait(self, record: UsageRecord) -> None:
        self.row = dataclasses.replace(
            record, request_id=self.request_id, endpoint=ENDPOINT, batch_id=self.batch_id
        )


def request_id(batch_id: str, line: int) -> str:
    """A line's usage row's request id (and its output line's): one per line, whichever
    gateway runs it, however often."""
    return f"{batch_id}-{line}"


def output_id(batch_id: str, line: int) -> str:
    """A line's output line's `id` (OpenAI's `batch_req_...`), the same each time it runs."""
    return "batch_req_" + hashlib.sha256(request_id(batch_id, line).encode()).hexdigest()[:32]


def refused(line: ClaimedLine, error: APIError) -> LineAnswer:
    """A line its route refused, as its error file's line."""
    code = error.code or error.type
    result = {
        "id": output_id(*line.key),
        "custom_id": line.custom_id,
        "response": {
            "status_code": error.status,
            "request_id": request_id(*line.key),
            "body": error.body(),
        },
        "error": {"code": code, "message": error.message},
    }
    return LineAnswer("failed", result)


class LineRunner:
    """Runs claimed lines through the serving core; one per gateway."""

    def __init__(
        self, core: OpenAIServing, responses: ResponsesServing | None, priority: int
    ) -> None:
        self.core = core
        self.responses = responses
        self.priority = priority

    async def run(self, line: ClaimedLine, tenant: RequestTenant) -> LineAnswer | Retry:
        """The line's answer (done, or failed as its route would fail it), or Retry."""
        sink = LineSink(line.batch_id, request_id(*line.key))
        try:
            generation, render = await self._generation(line, tenant)
            generation = dataclasses.replace(
                generation,
                # Collected whole: the engine sends one update at its end, not one a step.
                params=dataclasses.replace(generation.params, output_kind=OutputKind.FINAL_ONLY),
                endpoint=ENDPOINT,
                priority=self.priority,
                stream=False,
            )
            answer = await self.core.start(
                generation, tenant, admit=self.core.admission.admit_quota, sink=sink
            )
        except Exception as exc:  # noqa: BLE001 - each becomes the line's answer or a retry
            return self._failure(line, exc, sink)
        try:
            await collect(answer)  # the usage row reaches the sink however this ends
            if any(c.finish_reason == "abort" for c in answer.choices):
                return Retry("cut short (the engine stopped or restarted)")
            body = await render(answer)
        except Exception as exc:  # noqa: BLE001
            return self._failure(line, exc, sink)
        figures = answer.figures
        result = {
            "id": output_id(*line.key),
            "custom_id": line.custom_id,
            "response": {"status_code": 200, "request_id": request_id(*line.key), "body": body},
            "error": None,
        }
        return LineAnswer(
            "done",
            result,
            figures.prompt_tokens,
            figures.cached_tokens,
            figures.completion_tokens,
            sink.row,
        )

    def _failure(self, line: ClaimedLine, exc: Exception, sink: LineSink) -> LineAnswer | Retry:
        """An exception as the line's failed answer (with the usage row of what it ran, if it
        reached the engine), or a Retry where the server, not the line, is at fault."""
        error = api_error(exc)
        if error is None:
            logger.error("batch line %s failed", request_id(*line.key), exc_info=exc)
            error = APIError(500, "the server failed to answer this line", type="server_error")
        if error.status in RETRIED_STATUSES or error.code == "rate_limiter_unavailable":
            return Retry(f"{error.status} {error.code or error.type}: {error.message}")
        answer = refused(line, error)
        row = sink.row
        if row is None:
            return answer
        return dataclasses.replace(
            answer,
            prompt_tokens=row.prompt_tokens,
            cached_tokens=row.cached_tokens,
            completion_tokens=row.completion_tokens,
            usage=row,
        )

    async def _generation(
        self, line: ClaimedLine, tenant: RequestTenant
    ) -> tuple[Generation, Render]:
        """What the line's route makes of its body, and how it renders the answer. Raises
        APIError as the route would."""
        model = BODIES.get(line.endpoint)
        if model is None:
            raise APIError(400, f"url {line.endpoint!r} is not a batch endpoint", param="url")
        try:
            body = await asyncio.to_thread(model.model_validate, line.body)
        except ValidationError as exc:
            first = exc.errors()[0]
            param = validation_param(first.get("loc", ()))
            message = f"{param}: {first.get('msg', 'invalid value')}" if param else "invalid body"
            raise APIError(400, message, param=param) from exc
        checks = self.core.checks
        if isinstance(body, ChatCompletionRequest):
            generation = await ChatServing(self.core).generation(body, tenant)
            return generation, lambda answer: json_body(answer, checks)
        if isinstance(body, CompletionRequest):
            generation = await CompletionServing(self.core).generation(body, tenant)
            return generation, lambda answer: json_body(answer, checks)
        assert isinstance(body, ResponsesRequest)
        responses = self.responses
        if responses is None:
            raise APIError(404, "this server does not serve the Responses API", code="not_found")
        meta, _, generation = await responses.generation(body, tenant)
        return generation, lambda answer: responses.result(meta, answer)
