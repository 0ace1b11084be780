"""A batch's input lines checked as their routes check a request, before anything runs: at
upload (gateway.openai.files), so that a line that would be a 4xx is reported with its number
then and not hours later, and by the batch runner before it runs a line.

A line is OpenAI's batch request, one JSON object: `custom_id` (1 to 512 characters, unique in
its file), `method` "POST", `url` one of BATCH_URLS and `body`, the request as that route
takes it. The body is parsed with the route's own request model and built as far as the route
builds it before the engine: the model and adapter resolved for the tenant, the server's
bounds, the sampling parameters, the chat template or the tokenizer, a grammar compiled, and
the prompt against the model's context. `stream` is refused (a batch's answers are lines of a
file), and a response's `background`.

`check_line` returns a BatchLine, or a LineError in the shape of OpenAI's BatchError (line,
code, message, param); a failure of the server's own (503: an engine down, 500) is raised, not
blamed on the line. `check_file` checks every line of a file and that no custom_id repeats.
Parsing runs in a thread, tokenizing in the routes' threads: a large file keeps the event loop
free between lines.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterable
from dataclasses import dataclass, field
from typing import Any, Literal

import pydantic_core
from pydantic import BaseModel, ValidationError

from gateway.http.errors import APIError, validation_param
from gateway.openai.chat import ChatServing
from gateway.openai.completions import CompletionServing
from gateway.openai.protocol import ChatCompletionRequest, CompletionRequest
from gateway.openai.responses.protocol import ResponsesRequest
from gateway.openai.responses.serving import ResponsesServing
from gateway.openai.serving import (
    Generation,
    OpenAIServing,
    compile_grammar,
    reserved_tokens,
)
from gateway.tenancy.auth import RequestTenant

BatchURL = Literal["/v1/chat/completions", "/v1/completions", "/v1/responses"]
BATCH_URLS: tuple[BatchURL, ...] = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
MAX_CUSTOM_ID_CHARS = 512
MAX_REPORTED = 20  # bad lines a refusal lists

# OpenAI's batch error codes where it has one; a refused body keeps its route's own code
# (model_not_found, context_length_exceeded, ...).
INVALID_JSON_LINE = "invalid_json_line"
MISSING_PARAMETER = "missing_required_parameter"
DUPLICATE_CUSTOM_ID = "duplicate_custom_id"
INVALID_REQUEST = "invalid_request"
# Each url's request body as its route parses it (the batch runner parses with these too).
BODIES: dict[str, type[BaseModel]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
    "/v1/responses": ResponsesRequest,
}


@dataclass(frozen=True, slots=True)
class BatchLine:
    """A line that its route would take: what to run, as the client wrote it."""

    number: int  # from 1, in the file
    custom_id: str
    url: BatchURL
    body: dict[str, Any]  # the request body, as JSON decoded it
    # What the route would reserve of the tenant's tokens (prompt + max_tokens): the line's
    # share of a batch's queued-token cap (gateway.openai.batches).
    tokens: int = 0


@dataclass(frozen=True, slots=True)
class LineError:
    """Why a line would be refused: OpenAI's BatchError (openai.types.BatchError)."""

    line: int
    code: str
    message: str
    param: str | None = None

    def __str__(self) -> str:
        return f"line {self.line}: {self.message}"

    def body(self) -> dict[str, Any]:
        return {"line": self.line, "code": self.code, "message": self.message, "param": self.param}


@dataclass(slots=True)
class FileCheck:
    """A whole file's verdict: its lines, the first bad ones (up to `max_errors`), how many
    were bad."""

    num_lines: int = 0
    errors: list[LineError] = field(default_factory=list)
    num_bad: int = 0

    @property
    def ok(self) -> bool:
        return self.num_bad == 0


async def check_line(
    core: OpenAIServing,
    tenant: RequestTenant,
    number: int,
    raw: bytes,
    *,
    responses: ResponsesServing | None = None,
    max_line_bytes: int | None = None,
) -> BatchLine | LineError:
    """Line `number` (from 1) of a batch file, without its newline, checked for `tenant` as
    its route would check it (`responses`: the Responses API, without which its lines are
    refused; `max_line_bytes`: the largest request body the server takes). Raises APIError
    (5xx) or the engine's failure where the server, not the line, is at fault."""
    parsed = await asyncio.to_thread(_parse, number, raw, max_line_bytes)
    if isinstance(parsed, LineError):
        return parsed
    line, body = parsed
    try:
        generation = await _generation(core, responses, tenant, line.url, body)
        if generation.params.guided is not None:
            await compile_grammar(
                generation.model, generation.params.guided, generation.guided_param
            )
        _check_context(generation)
    except APIError as exc:
        if exc.status >= 500:
            raise
        return _refused(number, exc)
    return dataclasses.replace(line, tokens=reserved_tokens(generation))


async def check_file(
    core: OpenAIServing,
    tenant: RequestTenant,
    lines: AsyncIterable[tuple[int, bytes]],
    *,
    responses: ResponsesServing | None = None,
    max_line_bytes: int | None = None,
    max_errors: int = MAX_REPORTED,
) -> FileCheck:
    """Every line checked (check_line), and each custom_id once in the file; the first
    `max_errors` bad lines kept, all counted. Raises as check_line does."""
    verdict = FileCheck()
    first_seen: dict[str, int] = {}
    async for number, raw in lines:
        verdict.num_lines += 1
        checked = await check_line(
            core, tenant, number, raw, responses=responses, max_line_bytes=max_line_bytes
        )
        if isinstance(checked, BatchLine):
            seen = first_seen.setdefault(checked.custom_id, number)
            if seen != number:
                checked = LineError(
                    number,
                    DUPLICATE_CUSTOM_ID,
                    f"custom_id {checked.custom_id!r} is line {seen}'s too: each line's must "
                    "be unique in the file",
                    "custom_id",
                )
        if isinstance(checked, LineError):
            verdict.num_bad += 1
            if len(verdict.errors) < max_errors:
                verdict.errors.append(checked)
    return verdict


def _parse(
    number: int, raw: bytes, max_line_bytes: int | None
) -> tuple[BatchLine, BaseModel] | LineError:
    """The line's envelope and its body parsed by the route's model (in a thread: a long line
    is CPU time)."""

    def bad(code: str, message: str, param: str | None = None) -> LineError:
        return LineError(number, code, message, param)

    if max_line_bytes is not None and len(raw) > max_line_bytes:
        return bad(
            "request_too_large",
            f"longer than the {max_line_bytes} bytes a request body may have here",
            "body",
        )
    if not raw.strip():
        return bad(INVALID_JSON_LINE, "a blank line: each line is one request, as a JSON object")
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return bad(INVALID_JSON_LINE, f"not UTF-8 text (byte {exc.start + 1} of the line)")
    try:
        envelope = pydantic_core.from_json(raw, allow_inf_nan=False)
    except ValueError as exc:
        return bad(INVALID_JSON_LINE, f"not valid JSON: {exc}")
    if not isinstance(envelope, dict):
        return bad(INVALID_JSON_LINE, "a line is one JSON object (custom_id, method, url, body)")
    for name in ("custom_id", "method", "url", "body"):
        if name not in envelope:
            return bad(MISSING_PARAMETER, f"{name} is required", name)
    custom_id, method, url, body = (envelope[k] for k in ("custom_id", "method", "url", "body"))
    if not (isinstance(custom_id, str) and 0 < len(custom_id) <= MAX_CUSTOM_ID_CHARS):
        return bad(
            "invalid_custom_id",
            f"custom_id must be a string of 1 to {MAX_CUSTOM_ID_CHARS} characters",
            "custom_id",
        )
    if method != "POST":
        return bad("invalid_method", f"method must be POST, not {method!r}", "method")
    if url not in BATCH_URLS:
        return bad("invalid_url", f"url must be one of {', '.join(BATCH_URLS)}, not {url!r}", "url")
    if not isinstance(body, dict):
        return bad(INVALID_REQUEST, "body must be a JSON object: the request", "body")
    try:
        request = BODIES[url].model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = validation_param(first.get("loc", ()))
        where = "body" if param is None else f"body.{param}"
        return bad(INVALID_REQUEST, f"{where}: {first.get('msg', 'invalid value')}", where)
    if getattr(request, "stream", False):
        return bad(
            INVALID_REQUEST, "body.stream: a batch's answers are not streamed", "body.stream"
        )
    if getattr(request, "background", False):
        return bad(
            INVALID_REQUEST, "body.background: a batch's lines run in the batch", "body.background"
        )
    return BatchLine(number, custom_id, url, body), request


async def _generation(
    core: OpenAIServing,
    responses: ResponsesServing | None,
    tenant: RequestTenant,
    url: BatchURL,
    body: BaseModel,
) -> Generation:
    """What the route makes of the body before the engine (raises its APIError)."""
    if isinstance(body, CompletionRequest):
        return await CompletionServing(core).generation(body, tenant)
    if isinstance(body, ChatCompletionRequest):
        return await ChatServing(core).generation(body, tenant)
    assert isinstance(body, ResponsesRequest)
    if responses is None:
        raise APIError(404, "this server does not serve the Responses API", code="not_found")
    _, _, generation = await responses.generation(body, tenant)
    return generation


def _check_context(g: Generation) -> None:
    """The engine's refusal of a prompt with its output past the model's context
    (engine.llm_engine), said here: the engine is not asked until the line runs."""
    max_len, max_tokens = g.model.engine.facts.max_model_len, g.params.max_tokens
    for prompt in g.prompts:
        wanted = max_tokens or max_len - len(prompt)
        if len(prompt) + max(1, wanted) > max_len:
            raise APIError(
                400,
                f"this model's maximum context length is {max_len} tokens; the request asks "
                f"for {len(prompt)} prompt tokens plus {wanted} output tokens",
                param=g.form.prompt_param if g.endpoint != "responses" else "input",
                code="context_length_exceeded",
            )


def _refused(number: int, exc: APIError) -> LineError:
    """The route's refusal as the line's: its code, its field under `body`."""
    param = "body" if exc.param is None else f"body.{exc.param}"
    message = exc.message
    if exc.param is not None:
        named = message.startswith(f"{exc.param}:")
        message = f"body.{message}" if named else f"{param}: {message}"
    return LineError(number, exc.code or INVALID_REQUEST, message, param)
