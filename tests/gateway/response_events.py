"""The openai SDK's Responses stream event types, by their `type`, for tests that check the
events loragate sends one by one (so that an error names one type, not the whole union)."""

from __future__ import annotations

import typing
from typing import Any

from openai.types.responses import ResponseStreamEvent


def event_classes() -> dict[str, Any]:
    (union, _) = typing.get_args(ResponseStreamEvent)
    return {
        typing.get_args(kind.model_fields["type"].annotation)[0]: kind
        for kind in typing.get_args(union)
    }


EVENTS = event_classes()
