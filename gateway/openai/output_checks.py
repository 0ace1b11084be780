"""The safety net behind guided decoding: an output that ended where its grammar ends is
checked against its schema (a JSON document, or each tool call read out of free text); one
that fails is answered as `error`, counted and logged."""

from __future__ import annotations

import logging

from engine.request import GuidedSpec
from gateway.metrics import Metrics
from gateway.openai.answer import Choice
from gateway.openai.guided_validation import OutputValidator, Violation, checks
from gateway.openai.tools.calls import parameters
from gateway.openai.tools.stream import ToolCallStream

logger = logging.getLogger(__name__)


class OutputChecks:
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.validator = OutputValidator()

    async def check(self, spec: GuidedSpec | None, choice: Choice, request_id: str) -> None:
        """A guided document (or tool calls) that ended where its grammar ends, not at
        max_tokens nor at a stop string or token of the client's, against its schema; a
        failure is set on the choice. Metering and the engine's finish reason are left as
        they are: the tokens were generated."""
        if choice.finish_reason != "stop" or choice.stop_reason is not None:
            return
        if choice.calls is not None and choice.calls.fmt is not None:
            violation = await self._check_calls(choice.calls, choice.text)
        elif checks(spec):
            assert spec is not None
            violation = await self.validator.check(spec, choice.text)
        else:
            return
        if violation is None:
            return
        choice.violation = violation
        self.metrics.guided_invalid_outputs.labels(keyword=violation.keyword).inc()
        logger.warning(
            "%s choice %d: guided output failed its schema: keyword %s at %r (schema %r)",
            request_id,
            choice.index,
            violation.keyword,
            violation.pointer,
            violation.schema_pointer,
        )

    async def _check_calls(self, stream: ToolCallStream, text: str) -> Violation | None:
        """Each call read out of free text (tool_choice "auto") against its tool's schema."""
        tools = {t.function.name: t for t in stream.plan.tools}
        for call in stream.final(text)[1] or ():
            function = call["function"]
            spec = GuidedSpec(json_schema=parameters(tools[function["name"]]))
            violation = await self.validator.check(spec, function["arguments"])
            if violation is not None:
                return violation
        return None
