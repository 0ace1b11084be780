"""What a gateway sends an inference gateway for `routing: picker` (gateway.remote.picker_wire):
a body the endpoint picker accepts and reads (a completions request: `model` and a non-empty
`prompt`, whatever the path), whose engine request survives a picker that re-encodes the JSON,
and an event stream the engine's answer is decoded from."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from adapters.store import LocalAdapterStore
from engine.errors import RequestRefused
from engine.lora.types import LoRARequest
from engine.messages import EngineRequest
from engine.outputs import SequenceUpdate
from engine.request import SamplingParams
from gateway.remote.picker_wire import (
    DONE,
    KEEPALIVE,
    event,
    parse_event,
    read_body,
    request_body,
    split_events,
)
from gateway.remote.wire import decode_update, encode_update

SHA = "cd" * 32


class _Tokenizer:
    """Decodes ids as the words they index, so a test can say what the text is."""

    words = ["The", " quick", " brown", " fox"]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.words[i] for i in ids)


def _picker_reads(body: bytes) -> tuple[str, str]:
    """What the Inference Extension's picker takes of a POST to a path that is not one of
    OpenAI's: the body parsed as a completions request, `model` and `prompt`, both strings
    and the prompt not empty; any other body is its 400."""
    data = json.loads(body)
    model, prompt = data.get("model"), data.get("prompt")
    assert isinstance(model, str) and model, "the picker answers 400: no model"
    assert isinstance(prompt, str) and prompt, "the picker answers 400: no prompt"
    return model, prompt


def _request(lora: LoRARequest | None = None) -> EngineRequest:
    params = SamplingParams(max_tokens=3, temperature=0.0, seed=2**63 + 5)
    return EngineRequest("r1", [0, 1, 2, 3], params, lora=lora, cache_salt="salt-a")


def test_the_picker_reads_the_model_and_the_prompt_text() -> None:
    model, prompt = _picker_reads(request_body(_request(), "demo", _Tokenizer()))
    assert (model, prompt) == ("demo", "The quick brown fox")
    # An adapter's request names the adapter as the engines' running_lora_adapters do.
    lora = LoRARequest("ad_7f3a", "/gateway/path", SHA)
    model, _ = _picker_reads(request_body(_request(lora), "demo", _Tokenizer()))
    assert model == "ad_7f3a"


def test_a_prompt_that_decodes_to_nothing_still_gives_the_picker_text() -> None:
    class Silent:
        def decode(self, ids: list[int]) -> str:
            return ""

    _, prompt = _picker_reads(request_body(_request(), "demo", Silent()))
    assert prompt == "0 1 2 3"


def test_the_engine_request_survives_a_picker_that_re_encodes_numbers(tmp_path: Path) -> None:
    store = LocalAdapterStore(tmp_path / "store")
    request = _request(LoRARequest("ad_7f3a", "/gateway/path", SHA))
    body = request_body(request, "demo", _Tokenizer())
    # A Go picker holds JSON numbers as float64 and writes the body back from them.
    re_encoded = json.dumps(json.loads(body, parse_int=float)).encode()
    back = read_body(re_encoded, store)
    assert back.params.seed == 2**63 + 5
    assert back.prompt == [0, 1, 2, 3]
    assert back.cache_salt == "salt-a"
    assert back.lora == LoRARequest("ad_7f3a", str(store.path(SHA)), SHA)


@pytest.mark.parametrize(
    "body",
    [b"not json", b'{"model": "demo", "prompt": "hi"}', b'{"loragate": "[1, 2]"}', b"[]"],
)
def test_a_body_without_an_engine_request_is_refused(body: bytes) -> None:
    with pytest.raises(RequestRefused, match="not a loragate engine request"):
        read_body(body, None)


def test_events_decode_back_and_the_rest_carries_nothing() -> None:
    update = SequenceUpdate("r1", 0, [5, 6], "ab", [{5: -0.5}, {6: -1.0}], 4, 0)
    stream = event({"update": encode_update(update)}) + KEEPALIVE + DONE
    # However the stream is cut into chunks, the same events come out whole.
    for cut in range(1, len(stream)):
        first, rest = split_events(stream[:cut])
        second, left = split_events(rest + stream[cut:])
        assert first + second == [
            event({"update": encode_update(update)}).rstrip(),
            KEEPALIVE.rstrip(),
            DONE.rstrip(),
        ]
        assert left == b""
    data = parse_event(event({"update": encode_update(update)}).rstrip())
    assert data is not None
    assert decode_update(data["update"]) == update
    for quiet in (KEEPALIVE, DONE):
        assert parse_event(quiet.rstrip()) is None
