"""The OpenAI endpoints' shared core. An endpoint (gateway.openai.chat, .completions) makes a
`Generation` of its body: the base model and adapter resolved for the tenant (`resolve_model`),
the prompts tokenized, the sampling parameters and the server's bounds checked here. The core
starts it: the grammar compiled, admission, every prompt at the engine and its first update
received (so that a refusal is an HTTP error before anything is answered), the usage meter; then
it answers in one JSON body (gateway.openai.json_response) or in SSE (gateway.openai.sse), in
the endpoint's form.

Each prompt x n sample is one choice; the usage counts prompt, cached and completion tokens.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from fastapi.responses import JSONResponse, Response

from engine.errors import ContextLengthExceeded, GuidedSpecError, RequestRefused
from engine.lora.types import LoRARequest
from engine.messages import EngineRequest
from engine.request import GuidedSpec, SamplingParams
from gateway.http.errors import APIError, api_error
from gateway.http.request_limits import INVALID_GRAMMAR, INVALID_VALUE
from gateway.metrics import Metrics
from gateway.models.served import ServedModel, ServedModels
from gateway.openai.answer import Answer, AnswerForm, Choice, Timer, UpdateStream, Usage
from gateway.openai.json_response import Disconnected, collect, json_body, unless_disconnected
from gateway.openai.output_checks import OutputChecks
from gateway.openai.protocol import ChatCompletionRequest, CompletionRequest, FieldError
from gateway.openai.sse import MeteredStream, sse_chunks
from gateway.openai.tools.calls import ToolPlan
from gateway.openai.tools.parsers import FORMATS, ToolFormat
from gateway.openai.tools.stream import ToolCallStream
from gateway.tenancy.adapter_catalog import AdapterResolver, AmbiguousAdapter
from gateway.tenancy.admission import Admission, Ticket
from gateway.tenancy.auth import RequestTenant
from gateway.tenancy.metering import Meter, UsageSink

logger = logging.getLogger(__name__)

# The usage rows' endpoint of a batch line (gateway.openai.batches); its latencies are the
# batch histograms, not the interactive ones an autoscaler reads.
BATCH_ENDPOINT = "batch"
# What nginx logs for a client that hung up before its answer; no client ever reads it.
CLIENT_CLOSED_REQUEST = 499

# An admission: (tenant, request id, tokens to reserve) to its Ticket, or an APIError.
Admit = Callable[[RequestTenant, str, int], Awaitable[Ticket]]


@dataclass(frozen=True, slots=True)
class Generation:
    """What an endpoint made of its body: the engine's prompts and sampling parameters on a
    model (and adapter), and how the answer is shaped. The core starts it and answers it."""

    form: AnswerForm
    model: ServedModel
    lora: LoRARequest | None  # None: the base model itself
    named: str  # the `model` field as the client sent it
    request_id: str
    endpoint: str  # the API the usage row names
    prompts: list[list[int]]
    params: SamplingParams
    stream: bool  # SSE chunks, else one JSON body
    include_usage: bool  # SSE: a last chunk with the usage
    guided_param: str | None = None  # the field a grammar came from: its refusal names it
    tools: ToolPlan | None = None  # each choice's output read for calls
    tool_format: ToolFormat | None = None  # the calls' format under tool_choice "auto"
    routing_key: str | None = None  # the client's prompt_cache_key
    priority: int = 0  # its band in the engine (lower first): the client's, or a batch's


class OpenAIServing:
    def __init__(
        self,
        models: ServedModels,
        metrics: Metrics,
        admission: Admission,
        ledger: UsageSink,
        catalog: AdapterResolver | None = None,
        tool_call_parser: str | None = None,
    ) -> None:
        self.models = models
        self.admission = admission
        self.ledger = ledger
        self.metrics = metrics
        self.catalog = catalog  # None: LoRA is off
        self.checks = OutputChecks(metrics)
        # tool_choice "auto" reads calls in this format; None: auto is refused.
        self.tool_format = None if tool_call_parser is None else FORMATS[tool_call_parser]

    def models_for(self, tenant: RequestTenant) -> list[ServedModel]:
        """The base models this tenant may use."""
        allowed = tenant.allowed_models
        return [m for m in self.models if allowed is None or m.name in allowed]

    async def resolve_model(
        self, name: str, tenant: RequestTenant
    ) -> tuple[ServedModel, LoRARequest | None]:
        """The base model a `model` field names for this tenant, and the adapter on it (its
        own, else a public one; None: the base model itself). 404 otherwise, the same answer
        for another tenant's adapter as for a name that does not exist."""
        allowed = tenant.allowed_models  # a model outside it answers as one that does not exist
        model = self.models.get(name)
        if model is not None and (allowed is None or name in allowed):
            return model, None
        try:
            found = (
                None
                if self.catalog is None
                else await self.catalog.resolve(tenant.id, name, allowed)
            )
        except AmbiguousAdapter as exc:
            raise APIError(400, str(exc), param="model", code="ambiguous_model") from exc
        served = None if found is None else self.models.get(found.base_model)
        if found is None or served is None:
            raise APIError(
                404, f"The model `{name}` does not exist.", param="model", code="model_not_found"
            )
        return served, found.lora

    async def start(
        self,
        generation: Generation,
        tenant: RequestTenant,
        admit: Admit | None = None,
        sink: UsageSink | None = None,
    ) -> Answer:
        """Admit the generation and start its engine requests: a refusal (its grammar,
        admission, the engine's) is an HTTP error here, before anything is answered. From
        here on the request ends with exactly one usage row. `admit` and `sink` replace the
        tenant's admission and the usage ledger (a batch line is admitted by its quota alone,
        and its row is written with its answer: gateway.openai.batches)."""
        g = generation
        latency = (
            self.metrics.batch_latency if g.endpoint == BATCH_ENDPOINT else self.metrics.latency
        )
        timer = Timer(self.metrics, latency)  # time to first token includes a grammar's compile
        if g.params.guided is not None:
            await compile_grammar(g.model, g.params.guided, g.guided_param)
        ticket = await (admit or self.admission.admit)(tenant, g.request_id, reserved_tokens(g))
        try:
            updates = await self._submit(g, tenant)
        except BaseException:
            ticket.release(0)  # refused by the engine: nothing used
            raise
        meter = Meter(
            sink or self.ledger,
            ticket,
            self.metrics.tenants,
            tenant,
            g.request_id,
            g.model.name,
            # The adapter's own name: `sql@demo` is billed as `sql` (the row names demo).
            None if g.lora is None else g.named.partition("@")[0],
            g.lora,
            timer.start,
            endpoint=g.endpoint,
        )
        return Answer(
            request_id=g.request_id,
            model=g.named,
            form=g.form,
            params=g.params,
            stream=g.stream,
            include_usage=g.stream and g.include_usage,
            tokenizer=g.model.tokenizer,
            headers=ticket.headers,
            choices=[Choice(i, calls=_calls(g)) for i in range(len(g.prompts) * g.params.n)],
            usage=Usage(),
            timer=timer,
            meter=meter,
            updates=updates,
        )

    async def respond(self, answer: Answer, disconnected: Disconnected | None) -> Response:
        """Answer in one JSON body, or in SSE chunks."""
        if answer.stream:
            return MeteredStream(
                sse_chunks(answer, self.checks),
                on_close=answer.abandon,
                media_type="text/event-stream",
                headers=answer.headers,
            )
        if not await unless_disconnected(collect(answer), disconnected):
            # Nobody is left to answer; the engine's requests are aborted, the row written.
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return JSONResponse(await json_body(answer, self.checks), headers=answer.headers)

    @staticmethod
    async def _submit(g: Generation, tenant: RequestTenant) -> UpdateStream:
        """Every prompt at the engine and the first update received, so that the engine's
        refusals (context length, a grammar) become HTTP errors before anything is answered."""
        streams = [
            # The salt, the fairness key and its weight are the tenant's, never the client's.
            g.model.engine.generate(
                EngineRequest(
                    f"{g.request_id}-{i}",
                    prompt,
                    g.params,
                    lora=g.lora,
                    cache_salt=tenant.cache_salt,
                    fairness_key=tenant.id,
                    fairness_weight=tenant.weight,
                    routing_key=g.routing_key,
                    priority=g.priority,
                )
            )
            for i, prompt in enumerate(g.prompts)
        ]
        try:
            return await UpdateStream.open(streams)
        except ValueError as exc:
            raise _refusal(exc, g) from exc


def check_bounds(
    model: ServedModel, body: CompletionRequest | ChatCompletionRequest, num_prompts: int
) -> None:
    """The bounds that depend on this server and model: --max-n and the vocabulary."""
    model.bounds.check_choices(body.n, num_prompts)
    model.bounds.check_token_ids(body.stop_token_ids, "stop_token_ids")
    model.bounds.check_token_ids(body.logit_bias, "logit_bias")


def sampling_params(
    body: CompletionRequest | ChatCompletionRequest,
    max_tokens: int | None,
    logprobs: int | None,
) -> SamplingParams:
    """The body's sampling parameters; a bad value is a 400 naming its field."""
    try:
        return body.sampling_params(max_tokens, logprobs)
    except ValueError as exc:
        param = exc.param if isinstance(exc, FieldError) else None
        raise APIError(400, str(exc), param=param, code=INVALID_VALUE) from exc


async def compile_grammar(model: ServedModel, spec: GuidedSpec, param: str | None) -> None:
    """A spec that cannot compile (or not in time) answers 400 before anything is queued or
    streamed; the engine then finds the grammar in its cache."""
    try:
        await model.engine.compile_grammar(spec)
    except GuidedSpecError as exc:
        raise APIError(400, str(exc), param=param, code=INVALID_GRAMMAR) from exc


def reserved_tokens(g: Generation) -> int:
    """Tokens the limiter reserves: each prompt, and each sample's max_tokens (what remains of
    the context where none is given). The actual count replaces it at the end."""
    max_len, params = g.model.engine.facts.max_model_len, g.params
    return sum(
        len(p) + params.n * (params.max_tokens or max(0, max_len - len(p))) for p in g.prompts
    )


def _calls(g: Generation) -> ToolCallStream | None:
    """A choice's reader of tool calls, for a request with tools."""
    return None if g.tools is None else ToolCallStream(g.tools, g.tool_format)


def _refusal(exc: ValueError, g: Generation) -> APIError:
    """The engine's refusal of a request as the HTTP error that answers it."""
    if not isinstance(exc, RequestRefused):  # a malformed field the edge let through
        return APIError(400, str(exc), code=INVALID_VALUE)
    param = None
    if isinstance(exc, GuidedSpecError):
        param = g.guided_param
    elif isinstance(exc, ContextLengthExceeded):
        param = g.form.prompt_param
    error = api_error(exc, param)
    assert error is not None  # ENGINE_ERRORS has a row for every RequestRefused
    return error


# What the endpoints' route handlers share (gateway.openai.routes registers them under /v1).


def get_serving(request: Request) -> OpenAIServing:
    """The app's serving core; each request's endpoint is built over it."""
    serving: OpenAIServing = request.app.state.serving
    return serving


ServingDep = Annotated[OpenAIServing, Depends(get_serving)]


def hung_up(request: Request) -> Callable[[], Awaitable[None]]:
    """A wait that ends when the client disconnects (the body is read by then, so the next
    ASGI message is the disconnect)."""

    async def wait() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    return wait
