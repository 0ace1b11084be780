"""The official openai client against a live loragate server on 127.0.0.1."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import openai
import pytest
from live_server import Server, build_test_app, live_server

from engine import LLM, EngineConfig, LLMEngine, SamplingParams
from engine.frontend.async_engine import AsyncEngine
from engine.frontend.client import EngineClient
from engine.frontend.engine_process import EngineProcess

MODEL = "demo"


@pytest.fixture(scope="module", params=["thread", "process"])
def server(
    request: pytest.FixtureRequest, demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    """Every test runs against both engine loops: a thread of the server's process, and
    a process of its own (`loragate serve`'s default)."""
    config = EngineConfig(
        model=str(demo_model_dir), kv_cache_memory=64 << 20, max_model_len=512, dtype="float32"
    )
    engine: EngineClient
    if request.param == "thread":
        engine = AsyncEngine(LLMEngine(config), max_waiting=256)
        engine.start()
    else:
        engine = EngineProcess(replace(config, num_threads=1), max_waiting=256)
        engine.start()
    root = tmp_path_factory.mktemp("tenancy")
    app = build_test_app(engine, MODEL, root, demo_model_dir, max_body_bytes=1 << 20)
    with live_server(app, engine) as server:
        yield server
    asyncio.run(engine.shutdown(0))


@pytest.fixture(scope="module")
def offline(demo_model_dir: Path) -> LLM:
    return LLM(str(demo_model_dir), kv_cache_memory=32 << 20, max_model_len=512, dtype="float32")


def test_completion_matches_the_offline_engine(server: Server, offline: LLM) -> None:
    resp = server.client().completions.create(
        model=MODEL,
        prompt="The cat sat on the",
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    ref = offline.generate(
        ["The cat sat on the"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    )[0]
    assert resp.object == "text_completion" and resp.model == MODEL
    assert resp.choices[0].text == ref.outputs[0].text
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert resp.usage.completion_tokens == 12
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 12


def test_token_id_prompts_and_cached_tokens(server: Server) -> None:
    prompt = list(range(200, 264))
    client = server.client()
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert again.usage.prompt_tokens == 64
    assert again.usage.prompt_tokens_details.cached_tokens == 48


def test_chat_completion_shape(server: Server) -> None:
    resp = server.client().chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
        ],
        max_completion_tokens=8,
        temperature=0,
    )
    choice = resp.choices[0]
    assert resp.object == "chat.completion" and resp.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    assert resp.usage.completion_tokens <= 8


def test_streaming_with_usage_equals_the_whole_body(server: Server) -> None:
    client = server.client()
    kwargs = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Tell me a story"}],
        max_tokens=20,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    whole = client.chat.completions.create(**kwargs)
    chunks = list(
        client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_raw_sse_frames_end_with_done(server: Server) -> None:
    body = {
        "model": MODEL,
        "prompt": "abc",
        "max_tokens": 3,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream(
        "POST", f"{server.base_url}/v1/completions", headers=server.headers, json=body
    ) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        frames = [line for line in resp.iter_lines() if line]
    assert frames[-1] == "data: [DONE]"
    assert all(f.startswith("data: {") for f in frames[:-1])


def test_n_seed_stop_and_logprobs(server: Server) -> None:
    client = server.client()
    two = client.completions.create(
        model=MODEL,
        prompt="Once upon",
        max_tokens=10,
        n=2,
        temperature=1.0,
        seed=3,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in two.choices) == [0, 1]
    assert two.usage.completion_tokens == 20
    again = client.completions.create(
        model=MODEL,
        prompt="Once upon",
        max_tokens=10,
        n=2,
        temperature=1.0,
        seed=3,
        extra_body={"ignore_eos": True},
    )
    assert [c.text for c in two.choices] == [c.text for c in again.choices]

    base = client.completions.create(
        model=MODEL,
        prompt="Once upon",
        max_tokens=30,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    stop = base.choices[0].text[6:9]
    cut = client.completions.create(
        model=MODEL,
        prompt="Once upon",
        max_tokens=30,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert cut.choices[0].text == base.choices[0].text[: base.choices[0].text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"

    lp = client.completions.create(
        model=MODEL, prompt="Once upon", max_tokens=4, temperature=0, logprobs=3
    )
    assert len(lp.choices[0].logprobs.token_logprobs) == len(lp.choices[0].logprobs.tokens)
    assert all(len(top) >= 3 for top in lp.choices[0].logprobs.top_logprobs)
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "x"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    entry = chat.choices[0].logprobs.content[0]
    assert entry.logprob <= 0 and len(entry.top_logprobs) >= 2


def test_models_and_health(server: Server) -> None:
    models = server.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(f"{server.base_url}/health").status_code == 200


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"prompt": "x"}, 400, "model"),
        ({"model": MODEL, "prompt": "x", "temperature": "hot"}, 400, "temperature"),
        ({"model": MODEL, "prompt": "x", "temperature": -1}, 400, "temperature"),
        ({"model": "nope", "prompt": "x"}, 404, "model"),
        # Lower runs first; a tenant may not ask for a band better than everyone's default.
        ({"model": MODEL, "prompt": "x", "priority": -1}, 400, "priority"),
        ({"model": MODEL, "prompt": "x", "priority": 10**7}, 400, "priority"),
        ({"model": MODEL, "prompt": list(range(10, 600)), "max_tokens": 10}, 400, None),
        (
            {"model": MODEL, "prompt": "x", "response_format": {"type": "xml"}},
            400,
            "response_format.type",
        ),
    ],
)
def test_bad_requests_get_openai_errors(
    server: Server, body: dict, status: int, param: str | None
) -> None:
    resp = httpx.post(f"{server.base_url}/v1/completions", headers=server.headers, json=body)
    assert resp.status_code == status
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param
    assert server.wait_all_blocks_free()


def test_context_length_error_code_and_body_limit(server: Server) -> None:
    resp = httpx.post(
        f"{server.base_url}/v1/completions",
        headers=server.headers,
        json={"model": MODEL, "prompt": list(range(10, 600))},
    )
    assert resp.json()["error"]["code"] == "context_length_exceeded"
    big = httpx.post(
        f"{server.base_url}/v1/completions",
        content=b'{"model": "demo", "prompt": "' + b"a" * (2 << 20) + b'"}',
        headers={"content-type": "application/json"} | server.headers,
    )
    assert big.status_code == 413 and "error" in big.json()


def test_client_disconnect_frees_every_block(server: Server) -> None:
    body = {
        "model": MODEL,
        "prompt": "Once upon a time",
        "max_tokens": 400,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream(
        "POST", f"{server.base_url}/v1/completions", headers=server.headers, json=body
    ) as resp:
        lines = resp.iter_lines()
        for _ in range(3):
            next(lines)
    assert server.wait_all_blocks_free()


def test_fifty_concurrent_streams_complete_with_exact_usage(server: Server) -> None:
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[int, int]:
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"request {i}"}],
            max_tokens=8,
            temperature=0.7,
            seed=i,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        tokens = 0
        usage = None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            tokens += sum(1 for c in chunk.choices if c.delta.content)
        assert usage is not None
        return usage.completion_tokens, tokens

    async def run() -> list[tuple[int, int]]:
        client = openai.AsyncOpenAI(
            base_url=f"{server.base_url}/v1",
            api_key=server.tenancy.api_key,
            max_retries=0,
            timeout=60,
        )
        return await asyncio.gather(*(one(client, i) for i in range(50)))

    results = asyncio.run(run())
    assert [usage for usage, _ in results] == [8] * 50
    assert server.wait_all_blocks_free()


def test_metrics_count_requests_and_tokens(server: Server) -> None:
    before = httpx.get(f"{server.base_url}/metrics").text
    server.client().completions.create(
        model=MODEL, prompt="metrics", max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    text = httpx.get(f"{server.base_url}/metrics").text

    def value(body: str, name: str) -> float:
        for line in body.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    assert (
        value(text, "loragate:generation_tokens_total")
        - value(before, "loragate:generation_tokens_total")
        == 5
    )
    assert value(text, 'loragate:request_success_total{finish_reason="length"}') >= 1
    for name in (
        "loragate:num_requests_running",
        "loragate:num_requests_waiting",
        "loragate:kv_cache_usage_perc",
        "loragate:prefix_cache_queries_total",
        "loragate:prefix_cache_hits_total",
        "loragate:num_preemptions_total",
        "loragate:engine_yielded_steps_total",
        "loragate:time_to_first_token_seconds_count",
        "loragate:inter_token_latency_seconds_count",
        "loragate:e2e_request_latency_seconds_count",
        "loragate:request_queue_time_seconds_count",
    ):
        assert name in text, name


def test_a_failing_step_fails_its_requests_and_the_loop_keeps_serving(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not isinstance(server.engine, AsyncEngine):
        pytest.skip("patches the engine, which must run in this process")
    runner = server.engine.engine.runner
    real_execute = runner.execute
    calls = {"n": 0}

    def fail_once(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected fault")
        return real_execute(*args, **kwargs)

    monkeypatch.setattr(runner, "execute", fail_once)
    resp = httpx.post(
        f"{server.base_url}/v1/completions",
        headers=server.headers,
        json={"model": MODEL, "prompt": "fault", "max_tokens": 4},
    )
    assert resp.status_code == 500
    assert "injected fault" in resp.json()["error"]["message"]
    assert server.wait_all_blocks_free()
    ok = server.client().completions.create(
        model=MODEL, prompt="fault", max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
    )
    assert ok.usage.completion_tokens == 4
    assert httpx.get(f"{server.base_url}/health").status_code == 200
