"""The Files API through the openai SDK against a live loragate (demo model): batch files
uploaded, listed in pages, retrieved, read back byte for byte and deleted, every body checked
against the SDK's own types; a file whose lines its routes would refuse refused whole with the
bad lines by number (JSON, envelope, duplicates, the body as the route checks it: its model,
bounds, fields, stream, a grammar, the context) and nothing stored; 413 past the size and line
limits; purposes other than batch refused; another tenant's file answered exactly as an
unknown one on every route; a deleted tenant's files gone, rows and bytes."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from live_server import Server, admin_client, demo_server, new_tenant
from openai.types import FileDeleted, FileObject

MAX_BYTES = 64 << 10  # --batch-file-max-bytes here
MAX_LINES = 40  # --batch-file-max-lines here
MAX_BODY = 16 << 10  # --max-body-bytes here: a line's body may be no longer
MAX_FILES = 12  # --files-max-per-tenant here
UNKNOWN = "file-" + "0" * 32


@pytest.fixture(scope="module")
def server(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("files")
    settings = {
        "batch_file_max_bytes": MAX_BYTES,
        "batch_file_max_lines": MAX_LINES,
        "files_max_per_tenant": MAX_FILES,
    }
    with demo_server(demo_model_dir, root, settings=settings, max_body_bytes=MAX_BODY) as server:
        yield server


@pytest.fixture
def client(server: Server) -> openai.OpenAI:
    return server.client()


@pytest.fixture(autouse=True)
def no_files_left(server: Server) -> Iterator[None]:
    """Each test starts with none of the tester's files and deletes what it made (the cap)."""
    yield
    client = server.client()
    for made in client.files.list():
        client.files.delete(made.id)


def line(custom_id: str, url: str = "/v1/chat/completions", **body: Any) -> dict[str, Any]:
    """A batch request line: a small valid body for `url`, with `body`'s fields over it."""
    base: dict[str, Any] = {
        "/v1/chat/completions": {
            "model": "demo",
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 4,
        },
        "/v1/completions": {"model": "demo", "prompt": "Once upon", "max_tokens": 4},
        "/v1/responses": {"model": "demo", "input": "Hi", "max_output_tokens": 4},
    }[url]
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": base | body}


def jsonl(*lines: dict[str, Any] | str | bytes) -> bytes:
    """Lines as a file: dicts as JSON, text and bytes as they are; a newline after each."""
    out = b""
    for item in lines:
        if isinstance(item, dict):
            out += json.dumps(item).encode()
        elif isinstance(item, str):
            out += item.encode()
        else:
            out += item
        out += b"\n"
    return out


def upload(server: Server, data: bytes, key: str | None = None, **form: str) -> httpx.Response:
    """POST /v1/files by hand: `data` as the file part, `form` as text parts (purpose batch
    unless given)."""
    headers = {"Authorization": f"Bearer {key}"} if key else server.headers
    return httpx.post(
        f"{server.base_url}/v1/files",
        headers=headers,
        files={"file": ("requests.jsonl", data, "application/jsonl")},
        data={"purpose": "batch"} | form,
        timeout=60,
    )


def _raw(server: Server, method: str, path: str, key: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else server.headers
    return httpx.request(method, f"{server.base_url}/v1{path}", headers=headers, timeout=60)


def stored(server: Server) -> list[str]:
    """Every file name under the store's root, staged ones included."""
    root = server.tenancy.tenancy.files.root  # type: ignore[union-attr]
    return sorted(p.name for p in root.rglob("*") if p.is_file())


def test_a_file_is_uploaded_listed_read_and_deleted_through_the_sdk(
    server: Server, client: openai.OpenAI, tmp_path: Path
) -> None:
    data = jsonl(
        line("a"),
        line("b", "/v1/completions", temperature=0.5),
        line("c", "/v1/responses"),
        line("ü-ñ", messages=[{"role": "user", "content": "Grüße, 世界"}]),
    ).replace(b"\n", b"\r\n", 1)  # a CRLF, kept as it came
    path = tmp_path / "requests.jsonl"
    path.write_bytes(data)
    with path.open("rb") as f:
        made = client.files.create(file=f, purpose="batch")
    assert made.id.startswith("file-") and made.object == "file"
    assert (made.bytes, made.filename, made.purpose) == (len(data), "requests.jsonl", "batch")
    assert (made.status, made.status_details, made.expires_at) == ("processed", None, None)

    raw = _raw(server, "GET", f"/files/{made.id}")
    assert raw.status_code == 200 and set(raw.json()) == {
        "id",
        "object",
        "bytes",
        "created_at",
        "expires_at",
        "filename",
        "purpose",
        "status",
        "status_details",
    }
    assert FileObject.model_validate(raw.json()) == made
    assert client.files.retrieve(made.id) == made

    content = client.files.content(made.id)
    assert content.content == data  # byte for byte
    assert content.text == data.decode()
    assert content.response.headers["content-type"] == "application/octet-stream"
    assert "requests.jsonl" in content.response.headers["content-disposition"]

    assert [f.id for f in client.files.list()] == [made.id]
    deleted = _raw(server, "DELETE", f"/files/{made.id}")
    assert deleted.json() == {"id": made.id, "object": "file", "deleted": True}
    FileDeleted.model_validate(deleted.json())
    with pytest.raises(openai.NotFoundError) as caught:
        client.files.retrieve(made.id)
    assert caught.value.body == {
        "message": f"No such File object: {made.id}",
        "type": "invalid_request_error",
        "param": "file_id",
        "code": "file_not_found",
    }
    with pytest.raises(openai.NotFoundError):
        client.files.content(made.id)
    with pytest.raises(openai.NotFoundError):
        client.files.delete(made.id)  # once
    assert made.id not in stored(server)


def test_files_are_listed_in_pages_both_ways_and_by_purpose(
    server: Server, client: openai.OpenAI
) -> None:
    made = [
        client.files.create(file=(f"f{n}.jsonl", jsonl(line("x"))), purpose="batch")
        for n in range(5)
    ]
    newest_first = [f.id for f in reversed(made)]

    page = client.files.list(limit=2)
    assert [f.id for f in page.data] == newest_first[:2] and page.has_more
    assert [f.id for f in client.files.list(limit=2)] == newest_first  # the SDK pages on
    raw = _raw(server, "GET", f"/files?limit=2&after={newest_first[1]}").json()
    assert raw["object"] == "list" and raw["has_more"] is True
    assert (raw["first_id"], raw["last_id"]) == (newest_first[2], newest_first[3])
    oldest = client.files.list(order="asc", limit=3, after=made[0].id)
    assert [f.id for f in oldest.data] == [f.id for f in made[1:4]] and oldest.has_more
    assert [f.id for f in client.files.list(purpose="batch")] == newest_first
    assert list(client.files.list(purpose="batch_output")) == []
    empty = _raw(server, "GET", f"/files?after={UNKNOWN}").json()
    assert empty == {
        "object": "list",
        "data": [],
        "first_id": None,
        "last_id": None,
        "has_more": False,
    }


def test_a_file_with_bad_lines_is_refused_whole_naming_them(
    server: Server, client: openai.OpenAI
) -> None:
    data = jsonl(
        line("ok-1"),  # 1
        b'{"custom_id": "broken", ',  # 2: not JSON
        line("ok-1"),  # 3: the custom_id of line 1
        {**line("bad-url"), "url": "/v1/embeddings"},  # 4
        {**line("bad-method"), "method": "GET"},  # 5
        line("no-model", model="nobody"),  # 6
        line("negative", max_tokens=-1),  # 7
        line("streamed", stream=True),  # 8
        line("long", "/v1/completions", prompt="hello " * 2000, max_tokens=16),  # 9: context
        line("bad-field", temperature="hot"),  # 10
        "",  # 11: a blank line in the middle
        b'{"custom_id": "\xff"}',  # 12: not UTF-8
        line("too-many", n=1000),  # 13: past --max-n
        line("bad-regex", guided_regex="("),  # 14: a grammar that does not compile
        line("background", "/v1/responses", background=True),  # 15
        line("x" * 513),  # 16: a custom_id too long
        {"method": "POST", "url": "/v1/completions", "body": {}},  # 17: no custom_id
        line("lost", "/v1/responses", previous_response_id="resp_nothing"),  # 18
        line("past-the-context", max_tokens=5000),  # 19
        line("ok-2", "/v1/completions"),  # 20
        "[1, 2]",  # 21: not an object
        line("huge", messages=[{"role": "user", "content": "z" * MAX_BODY}]),  # 22
        line("ok-2", "/v1/completions"),  # 23: the custom_id of line 20
    )
    with pytest.raises(openai.BadRequestError) as caught:
        client.files.create(file=("bad.jsonl", data), purpose="batch")
    error = caught.value.body
    assert isinstance(error, dict)
    assert (error["type"], error["param"], error["code"]) == (
        "invalid_request_error",
        "file",
        "invalid_file",
    )
    listed = {entry["line"]: entry for entry in error["lines"]}
    bad = [n for n in range(1, 24) if n not in (1, 20)]
    assert sorted(listed) == bad[:20]
    assert error["message"].startswith("the file has 21 lines its route would refuse")
    assert all(f"line {n}: " in error["message"] for n in bad[:20])
    codes = {n: (entry["code"], entry["param"]) for n, entry in listed.items()}
    assert codes[2] == ("invalid_json_line", None)
    assert codes[3] == ("duplicate_custom_id", "custom_id")
    assert "line 1's" in listed[3]["message"]
    assert codes[4] == ("invalid_url", "url")
    assert codes[5] == ("invalid_method", "method")
    assert codes[6] == ("model_not_found", "body.model")
    assert codes[7] == ("invalid_request", "body.max_tokens")
    assert codes[8] == ("invalid_request", "body.stream")
    assert codes[9] == ("context_length_exceeded", "body.prompt")
    assert codes[10] == ("invalid_request", "body.temperature")
    assert codes[11] == ("invalid_json_line", None) and "blank" in listed[11]["message"]
    assert codes[12] == ("invalid_json_line", None) and "UTF-8" in listed[12]["message"]
    assert codes[13] == ("above_server_limit", "body.n")
    assert codes[14] == ("invalid_grammar", "body.guided_regex")
    assert codes[15] == ("invalid_request", "body.background")
    assert codes[16] == ("invalid_custom_id", "custom_id")
    assert codes[17] == ("missing_required_parameter", "custom_id")
    assert codes[18] == ("response_not_found", "body.previous_response_id")
    assert codes[19] == ("context_length_exceeded", "body.messages")
    assert codes[21] == ("invalid_json_line", None)
    # Past the first 20 bad lines, the rest are counted, not listed.
    assert error["message"].endswith("; and 1 more")

    assert list(client.files.list()) == []  # nothing was stored
    assert stored(server) == []


def test_a_line_longer_than_a_request_body_may_be_is_refused(
    server: Server, client: openai.OpenAI
) -> None:
    data = jsonl(line("ok"), line("huge", messages=[{"role": "user", "content": "z" * MAX_BODY}]))
    with pytest.raises(openai.BadRequestError) as caught:
        client.files.create(file=("big-line.jsonl", data), purpose="batch")
    assert isinstance(caught.value.body, dict)
    (entry,) = caught.value.body["lines"]
    assert (entry["line"], entry["code"]) == (2, "request_too_large")


def test_size_and_line_limits_are_413_and_store_nothing(server: Server) -> None:
    big = jsonl(*[line(f"id-{n}", max_tokens=1) for n in range(10)])
    big += b" " * (MAX_BYTES - len(big) + 1) + b"\n"  # past the file limit, within the form's
    raw = upload(server, big)
    assert raw.status_code == 413, raw.text
    assert raw.json()["error"]["param"] == "file"
    assert raw.json()["error"]["code"] == "file_too_large"
    huge = b"x" * (2 * MAX_BYTES + (128 << 10))  # past what the route reads at all
    raw = upload(server, huge)
    assert raw.status_code == 413, raw.text
    many = jsonl(*[line(f"id-{n}") for n in range(MAX_LINES + 1)])
    assert len(many) < MAX_BYTES
    raw = upload(server, many)
    assert raw.status_code == 413, raw.text
    assert f"{MAX_LINES + 1} lines" in raw.json()["error"]["message"]
    assert _raw(server, "GET", "/files").json()["data"] == [] and stored(server) == []
    exactly = upload(server, jsonl(*[line(f"id-{n}") for n in range(MAX_LINES)]))
    assert exactly.status_code == 200, exactly.text


def test_other_purposes_and_malformed_uploads_are_400(
    server: Server, client: openai.OpenAI
) -> None:
    for purpose in ("fine-tune", "assistants", "batch_output", "anything"):
        raw = upload(server, jsonl(line("a")), purpose=purpose)
        assert raw.status_code == 400, raw.text
        assert raw.json()["error"]["param"] == "purpose"
    with pytest.raises(openai.BadRequestError) as caught:
        client.files.create(file=("a.jsonl", jsonl(line("a"))), purpose="fine-tune")
    assert caught.value.param == "purpose"
    raw = httpx.post(
        f"{server.base_url}/v1/files",
        headers=server.headers,
        files={"file": ("a.jsonl", jsonl(line("a")))},
        timeout=60,
    )
    assert (raw.status_code, raw.json()["error"]["param"]) == (400, "purpose")
    raw = httpx.post(  # multipart, without a file part
        f"{server.base_url}/v1/files", headers=server.headers, files={"purpose": (None, "batch")}
    )
    assert (raw.status_code, raw.json()["error"]["param"]) == (400, "file")
    raw = upload(server, jsonl(line("a")), **{"expires_after[anchor]": "created_at"})
    assert (raw.status_code, raw.json()["error"]["param"]) == (400, "expires_after")
    raw = httpx.post(
        f"{server.base_url}/v1/files", headers=server.headers, json={"purpose": "batch"}
    )
    assert raw.status_code == 415
    empty = upload(server, b"")
    assert (empty.status_code, empty.json()["error"]["code"]) == (400, "empty_file")
    named = httpx.post(
        f"{server.base_url}/v1/files",
        headers=server.headers,
        files={"file": ("n" * 256, jsonl(line("a")))},
        data={"purpose": "batch"},
    )
    assert (named.status_code, named.json()["error"]["param"]) == (400, "file")
    assert list(client.files.list()) == [] and stored(server) == []


def test_a_tenant_holds_at_most_its_cap(server: Server, client: openai.OpenAI) -> None:
    for n in range(MAX_FILES):
        client.files.create(file=(f"f{n}.jsonl", jsonl(line("a"))), purpose="batch")
    with pytest.raises(openai.BadRequestError) as caught:
        client.files.create(file=("one-more.jsonl", jsonl(line("a"))), purpose="batch")
    assert caught.value.code == "too_many_files"
    first = client.files.list(order="asc", limit=1).data[0]
    client.files.delete(first.id)
    client.files.create(file=("now.jsonl", jsonl(line("a"))), purpose="batch")


def test_another_tenants_file_is_an_unknown_id_on_every_route(
    server: Server, client: openai.OpenAI
) -> None:
    mine = client.files.create(file=("mine.jsonl", jsonl(line("secret"))), purpose="batch")
    _, key = new_tenant(server, "other-files")
    routes = [
        ("GET", "/files/{f}"),
        ("GET", "/files/{f}/content"),
        ("DELETE", "/files/{f}"),
    ]

    def answers(file_id: str, who: str | None) -> list[tuple[int, str]]:
        found = []
        for method, path in routes:
            raw = _raw(server, method, path.format(f=file_id), who)
            found.append((raw.status_code, raw.text.replace(file_id, "ID")))
        return found

    theirs = answers(mine.id, key)
    assert all(status == 404 for status, _ in theirs)
    assert answers(UNKNOWN, key) == theirs  # the same bodies as for an id that never existed
    other = server.client(key)
    assert list(other.files.list()) == []
    assert other.files.list(after=mine.id).data == []
    # Nothing of it changed for its owner.
    assert client.files.content(mine.id).content == jsonl(line("secret"))
    # Once its owner deleted it, the owner hears what the other tenant heard.
    client.files.delete(mine.id)
    assert answers(mine.id, None) == theirs


def test_deleting_a_tenant_deletes_its_files(server: Server) -> None:
    tenant_id, key = new_tenant(server, "leaving-files")
    theirs = server.client(key)
    made = theirs.files.create(file=("bye.jsonl", jsonl(line("bye"))), purpose="batch")
    assert made.id in stored(server)
    with admin_client(server) as admin:
        assert admin.delete(f"/admin/tenants/{tenant_id}").status_code == 204
    assert made.id not in stored(server)
    store = server.tenancy.tenancy.files
    assert store is not None
    assert server.run(store.count(tenant_id)) == 0
    assert not (store.root / tenant_id).exists()
