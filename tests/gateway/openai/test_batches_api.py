"""The Batch API through the openai SDK against a live loragate (demo model): a file uploaded, a
batch made, polled to completed and its output downloaded, every custom_id once, each answer
the one the same request gets interactively (greedy), for chat, completions and responses
lines, with one usage row a line (endpoint `batch`, its batch's id) whose sums are the
output's; batches listed in pages; a file whose lines name another endpoint refused with
their numbers; cancel mid-run (the finished lines stay in the output); expiry (a window of
seconds: the finished lines kept, the rest `batch_expired` in the error file); another
tenant's batch or file answered exactly as an unknown one on every route; a tenant over its
monthly quota has its lines failed `insufficient_quota` while batches never touch its rpm;
the queued-token cap. Every body is checked against the SDK's own types."""

from __future__ import annotations

import dataclasses
import io
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from engine_services import metric_sum
from live_server import Server, admin_client, demo_server, new_tenant, usage_rows
from openai.types import Batch

from gateway.openai.batches.runner import RunnerOptions

LEASE = 3.0  # seconds a gateway's claim on a line lasts here
UNKNOWN_BATCH = "batch_" + "0" * 32
UNKNOWN_FILE = "file-" + "0" * 32
ENDED = ("completed", "failed", "expired", "cancelled")
LONG = {"ignore_eos": True}  # the demo model's answers run to max_tokens


@pytest.fixture(scope="module")
def server(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("batches")
    runner = RunnerOptions(max_concurrency=16, lease=LEASE, poll_interval=0.2)
    with demo_server(demo_model_dir, root, batch_runner=runner) as server:
        yield server


@pytest.fixture
def client(server: Server) -> openai.OpenAI:
    return server.client()


def chat(custom_id: str, text: str, **fields: Any) -> dict[str, Any]:
    body = {"model": "demo", "messages": [{"role": "user", "content": text}], "max_tokens": 8}
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": body | {"temperature": 0} | fields,
    }


def completion(custom_id: str, prompt: str, **fields: Any) -> dict[str, Any]:
    body = {"model": "demo", "prompt": prompt, "max_tokens": 8, "temperature": 0} | fields
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": body}


def response(custom_id: str, text: str, **fields: Any) -> dict[str, Any]:
    body = {"model": "demo", "input": text, "max_output_tokens": 8, "temperature": 0} | fields
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/responses", "body": body}


def upload(client: openai.OpenAI, lines: list[dict[str, Any]]) -> str:
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    return client.files.create(file=("batch.jsonl", io.BytesIO(data)), purpose="batch").id


def start(client: openai.OpenAI, lines: list[dict[str, Any]], **fields: Any) -> Batch:
    endpoint = lines[0]["url"]
    return client.batches.create(
        input_file_id=upload(client, lines),
        endpoint=endpoint,
        completion_window="24h",
        **fields,
    )


def wait(client: openai.OpenAI, batch_id: str, until: Any = None, timeout: float = 120.0) -> Batch:
    """The batch once `until(batch)` holds (default: it ended), polled; fails at the deadline."""
    done = until or (lambda b: b.status in ENDED)
    deadline = time.monotonic() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if done(batch):
            return batch
        assert time.monotonic() < deadline, f"batch {batch_id} still {batch.status}: {batch}"
        time.sleep(0.1)


def read_lines(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def raw(
    server: Server, method: str, path: str, key: str | None = None, **kw: Any
) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else server.headers
    return httpx.request(method, f"{server.base_url}/v1{path}", headers=headers, timeout=60, **kw)


def interactively(server: Server, line: dict[str, Any]) -> dict[str, Any]:
    answered = raw(server, "POST", line["url"].removeprefix("/v1"), json=line["body"])
    assert answered.status_code == 200, answered.text
    return answered.json()  # type: ignore[no-any-return]


def what_it_says(url: str, body: dict[str, Any]) -> Any:
    """The part of an answer a greedy request must repeat: its text, finish and tokens."""
    if url == "/v1/chat/completions":
        (choice,) = body["choices"]
        return choice["message"], choice["finish_reason"], body["usage"]["completion_tokens"]
    if url == "/v1/completions":
        (choice,) = body["choices"]
        return choice["text"], choice["finish_reason"], body["usage"]["completion_tokens"]
    texts = [part["text"] for item in body["output"] for part in item["content"]]
    return texts, body["status"], body["usage"]["output_tokens"]


def test_a_batch_runs_to_completed_and_answers_as_the_routes_do(
    server: Server, client: openai.OpenAI
) -> None:
    prompts = ["Hello there", "Tell me a story", "What is 2 + 2?", "Rivers of France"]
    for make in (chat, completion, response):
        lines = [make(f"{make.__name__}-{i}", text) for i, text in enumerate(prompts)]
        lines.append(make(f"{make.__name__}-long", "A long one", **_longer(make)))
        batch = start(client, lines, metadata={"job": make.__name__})
        assert (batch.status, batch.endpoint, batch.completion_window) == (
            "in_progress",
            lines[0]["url"],
            "24h",
        )
        assert batch.id.startswith("batch_") and batch.metadata == {"job": make.__name__}
        assert batch.request_counts is not None and batch.request_counts.total == len(lines)
        assert batch.expires_at is not None and batch.expires_at - batch.created_at == 86400

        done = wait(client, batch.id)
        assert done.status == "completed" and done.error_file_id is None
        assert done.request_counts is not None
        assert (done.request_counts.completed, done.request_counts.failed) == (len(lines), 0)
        assert done.completed_at is not None and done.finalizing_at is not None
        output = read_lines(client, done.output_file_id)
        assert [o["custom_id"] for o in output] == [line["custom_id"] for line in lines]
        assert len({o["id"] for o in output}) == len(lines)
        for sent, got in zip(lines, output, strict=True):
            assert got["error"] is None and got["id"].startswith("batch_req_")
            assert got["response"]["status_code"] == 200
            assert got["response"]["request_id"] == f"{batch.id}-{lines.index(sent) + 1}"
            body = got["response"]["body"]
            same = interactively(server, sent)
            assert what_it_says(sent["url"], body) == what_it_says(sent["url"], same)
        meta = client.files.retrieve(done.output_file_id or "")
        assert (meta.purpose, meta.filename) == ("batch_output", f"{batch.id}_output.jsonl")

        # One usage row a line, endpoint batch, its sums the output's and the batch's usage.
        rows = usage_rows(server.tenancy.settings.database_url, batch_id=batch.id)
        assert sorted(r["request_id"] for r in rows) == sorted(
            f"{batch.id}-{n}" for n in range(1, len(lines) + 1)
        )
        assert {r["endpoint"] for r in rows} == {"batch"}
        prompt, completion_tokens = _output_usage(output)
        assert sum(r["prompt_tokens"] for r in rows) == prompt
        assert sum(r["completion_tokens"] for r in rows) == completion_tokens
        assert done.usage is not None
        assert (done.usage.input_tokens, done.usage.output_tokens) == (prompt, completion_tokens)

        # The usage API groups and filters by batch.
        summary = raw(server, "GET", "/usage", params={"group_by": "batch", "batch_id": batch.id})
        assert summary.status_code == 200, summary.text
        (row,) = summary.json()["data"]
        assert (row["batch"], row["num_requests"]) == (batch.id, len(lines))
        assert row["prompt_tokens"] == prompt and row["completion_tokens"] == completion_tokens


def _longer(make: Any) -> dict[str, Any]:
    return {"max_output_tokens": 40} if make is response else {"max_tokens": 40}


def _output_usage(output: list[dict[str, Any]]) -> tuple[int, int]:
    prompt = completion = 0
    for line in output:
        usage = line["response"]["body"]["usage"]
        prompt += usage.get("prompt_tokens", usage.get("input_tokens", 0))
        completion += usage.get("completion_tokens", usage.get("output_tokens", 0))
    return prompt, completion


def test_batches_are_listed_newest_first_in_pages(client: openai.OpenAI) -> None:
    made = [start(client, [chat(f"page-{i}", "Hi", max_tokens=1)]).id for i in range(3)]
    first = client.batches.list(limit=2)
    assert [b.id for b in first.data] == made[::-1][:2] and first.has_more
    listed = [b.id for b in client.batches.list(limit=2)]  # the SDK follows `after`
    assert listed[:3] == made[::-1]
    for batch_id in made:
        wait(client, batch_id)


def test_a_file_with_lines_for_another_endpoint_is_refused_naming_them(
    server: Server, client: openai.OpenAI
) -> None:
    lines = [chat("a", "Hi"), completion("b", "Hi"), chat("c", "Hi"), response("d", "Hi")]
    file_id = upload(client, lines)
    body = {
        "input_file_id": file_id,
        "endpoint": "/v1/chat/completions",
        "completion_window": "24h",
    }
    refused = raw(server, "POST", "/batches", json=body)
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert (error["code"], error["param"]) == ("invalid_file", "input_file_id")
    assert [line["line"] for line in error["lines"]] == [2, 4]
    assert "line 2:" in error["message"] and "line 4:" in error["message"]
    assert {line["param"] for line in error["lines"]} == {"url"}
    assert all(b.input_file_id != file_id for b in client.batches.list(limit=100))
    # Other fields out of bounds: OpenAI's only window, its endpoints, its metadata's bounds.
    for wrong in (
        {"completion_window": "1h"},
        {"endpoint": "/v1/embeddings"},
        {"metadata": {f"k{i}": "v" for i in range(17)}},
        {"metadata": {"k": "v" * 513}},
        {"metadata": {"k" * 65: "v"}},
    ):
        answered = raw(
            server, "POST", "/batches", json=body | {"endpoint": "/v1/completions"} | wrong
        )
        assert answered.status_code == 400, (wrong, answered.text)


def test_cancel_mid_run_keeps_the_finished_lines(server: Server, client: openai.OpenAI) -> None:
    quick = [chat(f"quick-{i}", "Hi", max_tokens=2) for i in range(2)]
    slow = [chat(f"slow-{i}", f"Story {i}", max_tokens=900, **LONG) for i in range(12)]
    batch = start(client, quick + slow)
    wait(client, batch.id, lambda b: b.request_counts.completed >= 2)
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    assert cancelling.cancelling_at is not None
    done = wait(client, batch.id)
    assert done.status == "cancelled" and done.cancelled_at is not None
    output = read_lines(client, done.output_file_id)
    ids = [o["custom_id"] for o in output]
    assert len(ids) == len(set(ids)) >= 2 and {"quick-0", "quick-1"} <= set(ids)
    assert len(ids) < len(quick + slow)
    assert done.request_counts is not None and done.request_counts.completed == len(ids)
    rows = usage_rows(server.tenancy.settings.database_url, batch_id=batch.id)
    assert len(rows) == len(ids)  # the aborted lines are billed nothing
    assert server.wait_all_blocks_free(30)  # their sequences left the engine
    assert client.batches.cancel(batch.id).status == "cancelled"  # as it stands


def test_a_batch_not_done_in_its_window_expires_keeping_what_finished(
    server: Server, client: openai.OpenAI
) -> None:
    batches = server.app.state.batches
    policy = batches.policy
    batches.policy = dataclasses.replace(policy, completion_window=2.0)
    try:
        quick = [completion("quick", "Hi", max_tokens=1)]
        slow = [completion(f"slow-{i}", f"Story {i}", max_tokens=900, **LONG) for i in range(16)]
        batch = start(client, quick + slow)
    finally:
        batches.policy = policy
    assert batch.expires_at is not None and batch.expires_at - batch.created_at == 2
    done = wait(client, batch.id)
    assert done.status == "expired" and done.expired_at is not None
    output = read_lines(client, done.output_file_id)
    errors = read_lines(client, done.error_file_id)
    assert "quick" in [o["custom_id"] for o in output]
    expired = [e for e in errors if e["error"]["code"] == "batch_expired"]
    assert expired and all(e["response"] is None for e in expired)
    assert sorted(o["custom_id"] for o in output + errors) == sorted(
        line["custom_id"] for line in quick + slow
    )
    assert done.request_counts is not None
    assert (done.request_counts.completed, done.request_counts.failed) == (len(output), len(errors))
    assert server.wait_all_blocks_free(30)


def test_another_tenants_batch_or_file_is_an_unknown_id_on_every_route(
    server: Server, client: openai.OpenAI
) -> None:
    batch = start(client, [chat("mine", "Hi", max_tokens=1)])
    _, key = new_tenant(server, "batch-stranger")
    for batch_id in (batch.id, UNKNOWN_BATCH):
        answers = [
            raw(server, "GET", f"/batches/{batch_id}", key=key),
            raw(server, "POST", f"/batches/{batch_id}/cancel", key=key),
        ]
        for answered in answers:
            assert answered.status_code == 404, answered.text
            assert answered.json() == {
                "error": {
                    "message": f"No batch found with id '{batch_id}'.",
                    "type": "invalid_request_error",
                    "param": "batch_id",
                    "code": "batch_not_found",
                }
            }
    assert raw(server, "GET", "/batches", key=key).json()["data"] == []
    for file_id in (batch.input_file_id, UNKNOWN_FILE):
        body = {"input_file_id": file_id, "endpoint": "/v1/chat/completions"}
        made = raw(server, "POST", "/batches", key=key, json=body | {"completion_window": "24h"})
        assert made.status_code == 404, made.text
        assert made.json()["error"] == {
            "message": f"No such File object: {file_id}",
            "type": "invalid_request_error",
            "param": "input_file_id",
            "code": "file_not_found",
        }
    assert wait(client, batch.id).status == "completed"


def test_the_quota_fails_lines_and_batches_never_take_interactive_rpm(server: Server) -> None:
    _, broke = new_tenant(server, "batch-broke", monthly_token_quota=0)
    client = server.client(broke)
    done = wait(client, start(client, [chat("a", "Hi"), chat("b", "Hi")]).id)
    assert done.status == "completed" and done.output_file_id is None
    assert done.request_counts is not None and done.request_counts.failed == 2
    for failed in read_lines(client, done.error_file_id):
        assert failed["error"]["code"] == "insufficient_quota"
        assert failed["response"]["status_code"] == 429
        assert failed["response"]["body"]["error"]["code"] == "insufficient_quota"

    _, limited = new_tenant(server, "batch-rpm", rpm_limit=2)
    client = server.client(limited)
    done = wait(client, start(client, [chat(f"r{i}", "Hi", max_tokens=1) for i in range(5)]).id)
    assert done.request_counts is not None and done.request_counts.completed == 5
    line = chat("x", "Hi", max_tokens=1)
    codes = [
        raw(server, "POST", "/chat/completions", key=limited, json=line["body"]) for _ in range(3)
    ]
    assert [c.status_code for c in codes] == [200, 200, 429]


def test_the_queued_token_cap_refuses_a_batch_past_it(server: Server) -> None:
    tenant_id, key = new_tenant(server, "batch-capped", batch_token_limit=100)
    client = server.client(key)
    small = start(client, [chat("small", "Hi", max_tokens=20)])
    file_id = upload(client, [chat(f"big-{i}", "Hi", max_tokens=100) for i in range(2)])
    refused = raw(
        server,
        "POST",
        "/batches",
        key=key,
        json={
            "input_file_id": file_id,
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
        },
    )
    assert refused.status_code == 429, refused.text
    error = refused.json()["error"]
    assert error["code"] == "token_limit_exceeded"
    assert error["message"].startswith("Enqueued token limit reached for tenant batch-capped.")
    wait(client, small.id)
    with admin_client(server) as admin:
        lifted = admin.patch(f"/admin/tenants/{tenant_id}", json={"batch_token_limit": None})
        assert lifted.status_code == 200 and lifted.json()["batch_token_limit"] is None


def test_batch_lines_time_into_their_own_histograms(server: Server, client: openai.OpenAI) -> None:
    """An autoscaler or an SLO reads the interactive latencies: batch lines, which wait below
    interactive requests by design, are timed apart."""

    def counts() -> tuple[float, float]:
        text = httpx.get(f"{server.base_url}/metrics").text
        return (
            metric_sum(text, "loragate:time_to_first_token_seconds_count"),
            metric_sum(text, "loragate:batch_time_to_first_token_seconds_count"),
        )

    interactive, batch = counts()
    done = wait(client, start(client, [chat(f"m-{i}", f"Count to {i}") for i in range(3)]).id)
    assert done.status == "completed"
    assert counts() == (interactive, batch + 3)
