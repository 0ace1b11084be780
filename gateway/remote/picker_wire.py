"""One engine request as one HTTP request, for engines behind an inference gateway whose
endpoint picker chooses a pod per request (models-file `routing: picker`).

A WebSocket per gateway (gateway.remote.wire) is routed once and then pinned to one pod; here
each request travels alone, so the picker sees every one:

    POST /internal/v1/generate                       (the engine token in Authorization)
    {"model": "<the adapter's id, else the model's name>",
     "prompt": "<the prompt's text>",
     "loragate": "<the engine request, gateway.remote.wire's JSON, as a string>"}

    200 text/event-stream
    data: {"update": [...]}          a sequence's step (gateway.remote.wire.encode_update)
    data: {"error": [kind, text]}    a refusal or a failed step; nothing follows
    data: {"usage": {...}}           the request's token counts, before the end
    data: [DONE]
    : keepalive                      after KEEPALIVE_INTERVAL seconds of silence

The body is a completions request to the picker: it reads `model` (its LoRA-affinity scorer
matches it against the engines' `running_lora_adapters`, which name adapters by the same id)
and `prompt` (its prefix-cache scorer hashes the text), and it answers 400 to a POST body
without both. The engine reads only `loragate`, the token ids the gateway tokenized. That is a
string, not an object: a picker that re-encodes the body (Go maps hold numbers as float64)
would round a 64-bit seed. The response is SSE, not lines of JSON: a picker passes an event
stream through chunk by chunk but buffers any other body whole to read its usage.
"""

from __future__ import annotations

import json
from typing import Any

from adapters.store import AdapterStorage
from engine.errors import RequestRefused
from engine.messages import EngineRequest
from gateway.remote.wire import decode_request, encode_request

GENERATE_ROUTE = "/internal/v1/generate"
KEEPALIVE_INTERVAL = 2.0  # seconds; a gateway that hears nothing for several gives up
DONE = b"data: [DONE]\n\n"
KEEPALIVE = b": keepalive\n\n"


def request_body(request: EngineRequest, model: str, tokenizer: Any) -> bytes:
    """The POST body for `request` of the model named `model` (the picker's view of it)."""
    prompt = request.prompt
    if not isinstance(prompt, str):
        prompt = tokenizer.decode(prompt) or " ".join(map(str, prompt))  # never empty
    name = request.lora.name if request.lora is not None else model
    body = {"model": name, "prompt": prompt, "loragate": json.dumps(encode_request(request))}
    return json.dumps(body).encode()


def read_body(body: bytes, store: AdapterStorage | None) -> EngineRequest:
    """The engine request a POST body carries. Raises RequestRefused where it carries none."""
    try:
        data = json.loads(body)
        wire = json.loads(data["loragate"])
    except (ValueError, KeyError, TypeError) as exc:
        raise RequestRefused(f"not a loragate engine request: {exc}") from exc
    if not isinstance(wire, dict):
        raise RequestRefused("not a loragate engine request: `loragate` is not an object")
    return decode_request(wire, store)


def event(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data).encode() + b"\n\n"


def split_events(buffer: bytes) -> tuple[list[bytes], bytes]:
    """The whole events in `buffer` (each without its blank line), and what is left of the
    next one."""
    *whole, rest = buffer.split(b"\n\n")
    return whole, rest


def parse_event(raw: bytes) -> dict[str, Any] | None:
    """An event's data; None for what carries none (keepalive comments, the final [DONE],
    which the caller checks for first)."""
    if not raw.startswith(b"data: ") or raw == DONE.rstrip():
        return None
    data = json.loads(raw[6:])
    if not isinstance(data, dict):
        raise ValueError(f"an event that is not an object: {raw[:80]!r}")
    return data
