"""No request may fail, stall or slow another: each hostile request found against `loragate
serve` (issue 14's table) is answered alone, in OpenAI's shape, while a victim's request
runs on undisturbed. The server runs the engine in its own process, as `serve` does."""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
from live_server import Server, build_test_app, live_server

from engine import EngineConfig
from engine.frontend.engine_process import EngineProcess
from gateway.http.request_limits import RequestLimits

MODEL = "demo"
MAX_BODY = 1 << 20
VICTIM = {
    "model": MODEL,
    "prompt": "The victim's story begins",
    "max_tokens": 200,
    "temperature": 0,
    "ignore_eos": True,
}


@pytest.fixture(scope="module")
def server(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    config = EngineConfig(
        model=str(demo_model_dir),
        kv_cache_memory=64 << 20,
        max_model_len=512,
        num_threads=1,
        dtype="float32",
    )
    engine = EngineProcess(replace(config), max_waiting=64)
    engine.start()
    app = build_test_app(
        engine,
        MODEL,
        tmp_path_factory.mktemp("tenancy"),
        demo_model_dir,
        max_body_bytes=MAX_BODY,
        limits=RequestLimits(max_n=8),
    )
    with live_server(app, engine) as server:
        yield server
    asyncio.run(engine.shutdown(0))


@pytest.fixture(scope="module")
def victim_text(server: Server) -> str:
    """The victim's output with nothing else running."""
    resp = httpx.post(
        f"{server.base_url}/v1/completions", headers=server.headers, json=VICTIM, timeout=60
    )
    return str(resp.json()["choices"][0]["text"])


class Victim:
    """A victim's request in flight (streamed, in a thread) while the test sends another."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.started = threading.Event()
        self.text: str | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.started.wait(30), "the victim's request never started"

    def _run(self) -> None:
        with httpx.stream(
            "POST",
            f"{self.server.base_url}/v1/completions",
            headers=self.server.headers,
            json=VICTIM | {"stream": True},
            timeout=60,
        ) as resp:
            text = []
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    text.append(json.loads(line[6:])["choices"][0]["text"])
                    self.started.set()
            self.text = "".join(text)

    def result(self) -> str:
        self.thread.join(60)
        assert self.text is not None
        return self.text


def _expect_error(resp: httpx.Response, status: int, param: str | None) -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    return error


@pytest.mark.parametrize(
    ("field", "value", "param"),
    [
        ("n", 1099511627776, "n"),
        ("n", 9, "n"),  # the server's --max-n is 8
        ("seed", 2**70, "seed"),
        ("seed", -(2**70), "seed"),
        ("max_tokens", 2**40, "max_tokens"),
        ("top_k", 2**63, "top_k"),
        ("stop", ["x"] * 17, "stop"),
        ("stop", "x" * 257, "stop"),
        ("stop_token_ids", [10**6], "stop_token_ids"),
        ("logit_bias", {"5": 101}, "logit_bias.5"),
        ("logit_bias", {"999999": 1}, "logit_bias"),
        ("logit_bias", {str(i): 1 for i in range(1025)}, "logit_bias"),
        ("min_tokens", 20, None),  # above max_tokens
        ("prompt", [[1, 2], [10**7]], "prompt"),
        ("prompt", "x" * 20000, "prompt"),  # past 32 characters per token of max_model_len
        ("user", "u" * 257, "user"),
    ],
)
def test_an_out_of_bounds_field_is_a_400_and_the_victim_runs_on(
    server: Server, victim_text: str, field: str, value: object, param: str | None
) -> None:
    victim = Victim(server)
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 8} | {field: value}
    _expect_error(
        httpx.post(f"{server.base_url}/v1/completions", headers=server.headers, json=body),
        400,
        param,
    )
    assert victim.result() == victim_text
    assert server.wait_all_blocks_free()


def test_a_single_stop_string_is_bounded_as_a_listed_one_is(server: Server) -> None:
    """The 16 bounds the list, not a lone string's characters (it once did both)."""
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "stop": "never seen " * 4}
    resp = httpx.post(f"{server.base_url}/v1/completions", headers=server.headers, json=body)
    assert resp.status_code == 200, resp.text


def test_chat_fields_are_bounded_too(server: Server) -> None:
    url = f"{server.base_url}/v1/chat/completions"
    message = {"role": "user", "content": "hi"}
    cases = [
        ({"messages": [message] * 1025}, "messages"),
        ({"messages": [message], "n": 2**40}, "n"),
        ({"messages": [message], "top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "y" * 20000}]}, "messages"),
        ({"messages": [message], "max_completion_tokens": 0}, "max_completion_tokens"),
    ]
    for extra, param in cases:
        _expect_error(
            httpx.post(url, headers=server.headers, json={"model": MODEL} | extra), 400, param
        )


def _raw(server: Server) -> http.client.HTTPConnection:
    host, port = server.base_url.removeprefix("http://").split(":")
    return http.client.HTTPConnection(host, int(port), timeout=30)


def _post_raw(conn: http.client.HTTPConnection, body: bytes, server: Server) -> tuple[int, dict]:
    headers = {"content-type": "application/json"} | server.headers
    conn.request("POST", "/v1/completions", body, headers)
    resp = conn.getresponse()
    return resp.status, json.loads(resp.read())


@pytest.mark.parametrize(
    "body",
    [
        b'{"model": "demo", "prompt": "a\\ud800b", "max_tokens": 2}',  # a lone surrogate
        b'{"model": "demo", "prompt": "hi", "temperature": NaN}',
        b'{"model": "demo", "prompt": "hi", "top_p": Infinity}',
        b'{"model": "demo", "prompt": "hi", "presence_penalty": -Infinity}',
        b'{"model": "demo", "prompt": "\xff\xfe"}',  # not UTF-8
        b'{"model": "demo", "prompt": ' + b"[" * 300 + b"]" * 300 + b"}",
        b'{"model": "demo", "prompt": "hi"',  # truncated
    ],
    ids=["lone-surrogate", "nan", "infinity", "-infinity", "not-utf8", "deep", "truncated"],
)
def test_a_body_that_is_not_json_is_a_400_and_the_connection_stays_usable(
    server: Server, body: bytes
) -> None:
    conn = _raw(server)
    status, answer = _post_raw(conn, body, server)
    assert status == 400 and set(answer["error"]) == {"message", "type", "param", "code"}
    sock = conn.sock
    ok = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}).encode()
    assert _post_raw(conn, ok, server)[0] == 200
    assert conn.sock is sock  # the same keep-alive connection answered both
    conn.close()


def test_a_chunked_body_past_the_limit_is_a_413_before_it_is_read(server: Server) -> None:
    """200 MiB sent chunked (no Content-Length): refused once 1 MiB has arrived; the server
    stops reading, so the sender cannot push more than what the socket buffers hold."""
    host, port = server.base_url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"transfer-encoding: chunked\r\n\r\n"
    )
    chunk = b"a" * (1 << 16)
    frame = f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
    sent = 0
    sock.settimeout(5)
    try:
        while sent < 200 << 20:
            sock.sendall(frame)
            sent += len(chunk)
    except (BrokenPipeError, ConnectionResetError, TimeoutError):
        pass
    sock.settimeout(30)
    answer = b""
    while b"\r\n\r\n" not in answer:
        data = sock.recv(65536)
        if not data:
            break
        answer += data
    sock.close()
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert sent < 64 << 20
    assert httpx.get(f"{server.base_url}/health").json() == {"status": "ok"}
    assert server.wait_all_blocks_free()


def test_logit_bias_steers_greedy_tokens(server: Server) -> None:
    url = f"{server.base_url}/v1/completions"
    body = {"model": MODEL, "prompt": "Once upon", "max_tokens": 6, "temperature": 0}
    plain = httpx.post(url, headers=server.headers, json=body | {"logprobs": 0}).json()["choices"][
        0
    ]
    forced = httpx.post(
        url, headers=server.headers, json=body | {"logit_bias": {"77": 100}, "logprobs": 0}
    ).json()
    tokens = forced["choices"][0]["logprobs"]["tokens"]
    assert len(tokens) == 6 and len(set(tokens)) == 1  # token 77 every time
    first = plain["logprobs"]["tokens"][0]
    assert first != tokens[0]


def test_a_banned_token_stays_banned_under_a_grammar(server: Server) -> None:
    url = f"{server.base_url}/v1/completions"
    body = {"model": MODEL, "prompt": "Pick:", "max_tokens": 8, "temperature": 0}
    choices = ["left", "right"]
    chosen = httpx.post(url, headers=server.headers, json=body | {"guided_choice": choices}).json()[
        "choices"
    ][0]["text"]
    assert chosen in choices
    # Ban every token that could begin the chosen answer: the grammar must take the other.
    tokenizer = server.engine.facts.tokenizer
    banned = {
        token: -100
        for token in range(server.engine.facts.vocab_size)
        if (text := tokenizer.decode([token])) and chosen.startswith(text)
    }
    assert banned
    steered = httpx.post(
        url, headers=server.headers, json=body | {"guided_choice": choices, "logit_bias": banned}
    )
    assert steered.json()["choices"][0]["text"] == next(c for c in choices if c != chosen)


def test_an_unexpected_exception_is_a_json_500_with_a_request_id(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert server.app is not None
    serving = server.app.state.serving

    def broken(name: str) -> None:
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(serving, "resolve_model", broken)
    conn = _raw(server)
    status, answer = _post_raw(conn, json.dumps({"model": MODEL, "prompt": "hi"}).encode(), server)
    assert status == 500 and answer["error"]["type"] == "internal_error"
    assert "request id req_" in answer["error"]["message"]
    assert "a bug" not in answer["error"]["message"]  # internals stay in the log
    monkeypatch.undo()
    ok = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}).encode()
    assert _post_raw(conn, ok, server)[0] == 200
    conn.close()
