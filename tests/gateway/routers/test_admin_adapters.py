"""Adapters through the admin REST: uploads validated before anything is stored, scoped names
(a tenant's own, public ones, nobody else's), the content-addressed store, deletion; on SQLite
and PostgreSQL."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
from live_server import Server, admin_client, new_tenant

from adapters.demo import build_demo_adapter
from adapters.peft import CONFIG_FILE, WEIGHTS_FILE, adapter_identity

MODEL = "demo"
PROMPT = [5, 77, 301, 1200, 42, 9, 640]


def _files(directory: Path, **replace: bytes) -> dict[str, tuple[str, bytes, str]]:
    parts = {}
    for name, mime in (
        (CONFIG_FILE, "application/json"),
        (WEIGHTS_FILE, "application/octet-stream"),
    ):
        data = replace.get(name.split(".")[0], (directory / name).read_bytes())
        parts[name] = (name, data, mime)
    return parts


def upload(
    admin: httpx.Client, directory: Path, name: str, tenant_id: str | None = None, **replace: bytes
) -> httpx.Response:
    data = {"name": name} | ({"tenant_id": tenant_id} if tenant_id else {})
    return admin.post("/admin/adapters", data=data, files=_files(directory, **replace))


def _tokens(server: Server, key: str, model: str) -> httpx.Response:
    return httpx.post(
        f"{server.base_url}/v1/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={
            "model": model,
            "prompt": PROMPT,
            "max_tokens": 6,
            "temperature": 0,
            "ignore_eos": True,
        },
        timeout=60,
    )


def _stored(server: Server) -> list[str]:
    """The identities in the adapter store (and fails if an upload was left half-way)."""
    root = server.tenancy.settings.adapter_store
    assert not list((root / ".incoming").iterdir()), "an upload was left in .incoming"
    return sorted(p.name for p in root.iterdir() if p.name != ".incoming")


def test_uploads_are_scoped_to_their_owner_and_public_ones_to_everyone(
    tenancy_server: Server, demo_adapters: dict[str, Path]
) -> None:
    server = tenancy_server
    a_id, a_key = new_tenant(server, "tenant-a")
    b_id, b_key = new_tenant(server, "tenant-b")
    r8, r4 = demo_adapters["r8-all"], demo_adapters["r4-attn"]
    with admin_client(server) as admin:
        mine = upload(admin, r8, "mine", a_id)
        assert mine.status_code == 201, mine.text
        body = mine.json()
        assert body["tenant_id"] == a_id and body["rank"] == 8 and body["name"] == "mine"
        assert body["sha256"] == adapter_identity(r8) and body["base_model"] == MODEL
        assert set(body["target_modules"]) == {
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        }
        assert upload(admin, r4, "shared").status_code == 201  # public
        assert upload(admin, r8, "mine", a_id).status_code == 409
        assert upload(admin, r4, "mine", b_id).status_code == 201  # another owner's namespace
        # The caller's own name wins over a public one of the same name.
        assert upload(admin, r4, "dup").status_code == 201
        assert upload(admin, r8, "dup", a_id).status_code == 201

        def models(key: str) -> set[str]:
            resp = httpx.get(
                f"{server.base_url}/v1/models", headers={"Authorization": f"Bearer {key}"}
            )
            return {m["id"] for m in resp.json()["data"]}

        assert models(a_key) == {MODEL, "mine", "shared", "dup"}
        assert models(b_key) == {MODEL, "mine", "shared", "dup"}  # b's own "mine" (rank 4)
        c_id, c_key = new_tenant(server, "tenant-c")
        assert models(c_key) == {MODEL, "shared", "dup"}

        base = _tokens(server, a_key, MODEL).json()["choices"][0]["text"]
        a_mine = _tokens(server, a_key, "mine").json()["choices"][0]["text"]
        assert a_mine != base
        assert _tokens(server, a_key, "dup").json()["choices"][0]["text"] == a_mine
        shared = _tokens(server, c_key, "shared").json()["choices"][0]["text"]
        assert _tokens(server, c_key, "dup").json()["choices"][0]["text"] == shared
        assert _tokens(server, b_key, "mine").json()["choices"][0]["text"] == shared  # b's is r4

        # Another tenant's adapter: the very answer a name that exists nowhere gets.
        hidden = _tokens(server, c_key, "mine")
        assert hidden.status_code == 404 and hidden.json()["error"]["code"] == "model_not_found"
        for secret in (a_id, a_key[:11], str(server.tenancy.settings.adapter_store)):
            assert secret not in hidden.text
        listed = admin.get("/admin/adapters", params={"tenant_id": a_id}).json()["data"]
        assert {row["name"] for row in listed} == {"mine", "dup"}
        assert len(admin.get("/admin/adapters").json()["data"]) == 5
        # Same bytes, stored once: r8 (a's two) and r4 (three rows).
        assert _stored(server) == sorted({adapter_identity(r8), adapter_identity(r4)})

        ids = {row["name"]: row["id"] for row in listed}
        assert admin.delete(f"/admin/adapters/{ids['mine']}").status_code == 204
        gone = _tokens(server, c_key, "mine")  # nobody has "mine" now but b
        assert _tokens(server, a_key, "mine").text.replace(a_key, "") == gone.text
        assert admin.get(f"/admin/adapters/{ids['mine']}").status_code == 404
        assert adapter_identity(r8) in _stored(server)  # a's "dup" still holds those bytes
        assert admin.delete(f"/admin/adapters/{ids['dup']}").status_code == 204
        assert _stored(server) == [adapter_identity(r4)]
        # Deleting a tenant takes its adapters, and their files with the last reference.
        assert admin.delete(f"/admin/tenants/{b_id}").status_code == 204
        assert _tokens(server, b_key, MODEL).status_code == 401
        assert _stored(server) == [adapter_identity(r4)]  # the public ones still use it


def test_a_bad_upload_is_refused_and_leaves_no_row_and_no_file(
    tenancy_server: Server, demo_adapters: dict[str, Path], demo_model_dir: Path, tmp_path: Path
) -> None:
    server = tenancy_server
    tenant_id, _ = new_tenant(server, "uploader")
    r8 = demo_adapters["r8-all"]
    other_base = json.loads((r8 / CONFIG_FILE).read_text()) | {
        "base_model_name_or_path": "someone/other-model"
    }
    too_big_rank = build_demo_adapter(
        demo_model_dir, tmp_path / "r32", rank=32, targets="attention", seed=3
    )
    weights = (r8 / WEIGHTS_FILE).read_bytes()
    cases: list[tuple[str, dict, int]] = [
        ("corrupt weights", {"adapter_model": b"\x00" * 64}, 400),
        ("truncated weights", {"adapter_model": weights[: len(weights) // 2]}, 400),
        ("config not JSON", {"adapter_config": b"{not json"}, 400),
        ("another base model", {"adapter_config": json.dumps(other_base).encode()}, 400),
    ]
    with admin_client(server) as admin:
        for label, replace, status in cases:
            resp = upload(admin, r8, "bad", tenant_id, **replace)
            assert resp.status_code == status, (label, resp.text)
            assert resp.json()["error"]["code"] == "invalid_adapter", label
            assert str(server.tenancy.settings.adapter_store) not in resp.text
        resp = upload(admin, too_big_rank, "bad", tenant_id)
        assert resp.status_code == 400 and "rank" in resp.json()["error"]["message"]
        for name in (
            "../etc",
            "a/../b",
            "ünïcode",
            "x" * 10_000,
            "a'; DROP TABLE adapters;--",
            "",
            "/abs",
            "a b",
        ):
            resp = upload(admin, r8, name, tenant_id)
            assert resp.status_code == 400, name[:20]
            # A 10 kB name is refused by the form parser (a field over 1 KiB), unnamed.
            assert resp.json()["error"]["param"] == ("name" if len(name) < 1024 else None)
        assert upload(admin, r8, "bad", "ten_nobody").status_code == 404
        missing = admin.post(
            "/admin/adapters",
            data={"name": "bad"},
            files={CONFIG_FILE: (CONFIG_FILE, (r8 / CONFIG_FILE).read_bytes(), "application/json")},
        )
        assert missing.status_code == 400 and missing.json()["error"]["param"] == WEIGHTS_FILE
        wrong_type = admin.post(
            "/admin/adapters", content=b"name=bad", headers={"content-type": "text/plain"}
        )
        assert wrong_type.status_code == 415
        truncated = admin.post(
            "/admin/adapters",
            content=b'--b\r\nContent-Disposition: form-data; name="name"\r\n\r\nbad\r\n--b\r\nCont',
            headers={"content-type": "multipart/form-data; boundary=b"},
        )
        assert truncated.status_code == 400, truncated.text
        huge = admin.post(
            "/admin/adapters",
            data={"name": "bad"},
            files={WEIGHTS_FILE: (WEIGHTS_FILE, b"\x00" * (5 << 20), "application/octet-stream")},
        )
        assert huge.status_code == 413
        local = admin.post("/admin/adapters", json={"name": "bad", "path": str(r8)})
        assert local.status_code == 403  # server-local paths are off by default
        assert admin.get("/admin/adapters").json()["data"] == []
    assert _stored(server) == []
