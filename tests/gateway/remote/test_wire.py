"""What crosses between a gateway and a `loragate engine` comes back as it went: requests with
every sampling field (a guided spec, logit bias), updates with logprobs, refusals by type,
stats; an adapter arrives as the engine's own store path, never a path the peer chose."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from adapters.store import LocalAdapterStore
from engine.errors import ContextLengthExceeded, EngineOverloaded, RequestRefused, StepFailed
from engine.lora.types import LoRARequest
from engine.messages import EngineRequest, EngineStats
from engine.outputs import SequenceUpdate
from engine.request import GuidedSpec, OutputKind, SamplingParams
from gateway.remote.wire import (
    decode_error,
    decode_request,
    decode_stats,
    decode_update,
    encode_error,
    encode_request,
    encode_stats,
    encode_update,
)

SHA = "ab" * 32


def _over_the_wire(value: object) -> object:
    return json.loads(json.dumps(value))


def test_a_request_round_trips_with_the_engine_store_path(tmp_path: Path) -> None:
    params = SamplingParams(
        n=2,
        temperature=0.7,
        top_k=5,
        seed=2**63 + 5,
        logit_bias={17: -3.5, 4: 100.0},
        stop=["\\n\\n"],
        stop_token_ids=[2],
        logprobs=3,
        guided=GuidedSpec(json_schema={"type": "object"}, strict=False),
        output_kind=OutputKind.FINAL_ONLY,
    )
    request = EngineRequest(
        "r1",
        [5, 6, 7],
        params,
        lora=LoRARequest("sql", "/gateway/side/path", SHA),
        cache_salt="salt",
        fairness_key="ten_1",
        fairness_weight=2.0,
        priority=100,
    )
    store = LocalAdapterStore(tmp_path / "store")
    back = decode_request(_over_the_wire(encode_request(request)), store)  # type: ignore[arg-type]
    assert back.params == params
    assert back.params.output_kind is OutputKind.FINAL_ONLY
    assert back.lora == LoRARequest("sql", str(store.path(SHA)), SHA)
    assert (back.prompt, back.cache_salt, back.fairness_key, back.fairness_weight) == (
        [5, 6, 7],
        "salt",
        "ten_1",
        2.0,
    )
    assert back.priority == 100


@pytest.mark.parametrize(
    "change",
    [
        {"lora": ["sql", "../../etc"]},  # not a content hash: no path of the peer's choosing
        {"params": {"temperature": -1}},
        {"params": {"no_such_field": 1}},
        {"params": {"output_kind": "cumulative"}},
        {"prompt": ["a"]},
    ],
)
def test_a_request_that_does_not_decode_is_refused(tmp_path: Path, change: dict) -> None:
    good = encode_request(EngineRequest("r", [1, 2], SamplingParams()))
    with pytest.raises(RequestRefused):
        decode_request(good | change, LocalAdapterStore(tmp_path))


def test_an_adapter_for_an_engine_without_lora_is_refused() -> None:
    data = encode_request(
        EngineRequest("r", [1], SamplingParams(), lora=LoRARequest("a", "/p", SHA))
    )
    with pytest.raises(RequestRefused, match="no adapters"):
        decode_request(data, None)


def test_updates_errors_and_stats_round_trip() -> None:
    update = SequenceUpdate(
        "r", 1, [7, 8], "hi", [{7: -0.1, 3: -2.5}, {8: -0.2}], 12, 4, 0.01, "stop", 2, None
    )
    assert decode_update(_over_the_wire(encode_update(update))) == update  # type: ignore[arg-type]
    for error in (ContextLengthExceeded("long"), EngineOverloaded("full"), StepFailed("boom")):
        back = decode_error(_over_the_wire(encode_error(error)))  # type: ignore[arg-type]
        assert type(back) is type(error) and str(back) == str(error)
    # An exception the wire does not name arrives as a StepFailed with its message.
    assert isinstance(decode_error(encode_error(KeyError("x"))), StepFailed)
    stats = EngineStats(num_running=3, spec_decode=(1, 2, 3), resident_adapter_ids=[SHA])
    assert decode_stats(_over_the_wire(encode_stats(stats))) == stats  # type: ignore[arg-type]
