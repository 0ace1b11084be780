"""Who may call what: tenants' API keys over their whole life, and admin tokens, through HTTP
(the openai client where a tenant would use it), on SQLite and PostgreSQL."""

from __future__ import annotations

import base64
import json
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import openai
import pytest
from joserfc import jwt
from joserfc.jwk import KeySet, OctKey, RSAKey
from live_server import TEST_SECRET, Server, admin_client, build_test_app, live_server, new_tenant

from gateway.http.errors import APIError
from gateway.settings import Settings, derive
from gateway.tenancy.admin_auth import AdminAuth

MODEL = "demo"


def _complete(server: Server, key: str) -> httpx.Response:
    return httpx.post(
        f"{server.base_url}/v1/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={"model": MODEL, "prompt": "Hello", "max_tokens": 2},
        timeout=60,
    )


def _error(resp: httpx.Response, status: int, code: str) -> None:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code


def test_a_key_works_until_it_expires_is_revoked_or_its_tenant_is_suspended(
    tenancy_server: Server,
) -> None:
    server = tenancy_server
    tenant_id, key = new_tenant(server, "acme")
    reply = server.client(key).completions.create(model=MODEL, prompt="Hello", max_tokens=2)
    assert reply.usage.completion_tokens == 2

    with pytest.raises(openai.AuthenticationError):
        server.client("lg-" + "x" * 43).completions.create(model=MODEL, prompt="x", max_tokens=1)
    resp = httpx.get(f"{server.base_url}/v1/models")
    _error(resp, 401, "invalid_api_key")
    assert resp.headers["www-authenticate"] == "Bearer"
    _error(_complete(server, server.tenancy.admin_token), 401, "invalid_api_key")

    with admin_client(server) as admin:
        # A key is never born expired (a 400); these two expire 3 s from now, the naive
        # one taken as UTC.
        soon = datetime.now(UTC) + timedelta(seconds=3)
        expiring = [
            admin.post(f"/admin/tenants/{tenant_id}/keys", json={"expires_at": when}).json()
            for when in (soon.isoformat(), soon.replace(tzinfo=None).isoformat())
        ]
        time.sleep(max(0.0, (soon - datetime.now(UTC)).total_seconds()) + 0.05)
        for expired in expiring:
            _error(_complete(server, expired["key"]), 401, "invalid_api_key")

        second = admin.post(f"/admin/tenants/{tenant_id}/keys", json={"name": "ci"}).json()
        assert _complete(server, second["key"]).status_code == 200
        revoked = admin.delete(f"/admin/keys/{second['id']}")
        assert revoked.status_code == 200 and revoked.json()["revoked_at"] is not None
        _error(_complete(server, second["key"]), 403, "key_revoked")  # at once, on this replica
        assert _complete(server, key).status_code == 200  # the tenant's other key still works

        assert (
            admin.patch(f"/admin/tenants/{tenant_id}", json={"status": "suspended"}).json()[
                "status"
            ]
            == "suspended"
        )
        _error(_complete(server, key), 403, "tenant_suspended")
        admin.patch(f"/admin/tenants/{tenant_id}", json={"status": "active"})
        assert _complete(server, key).status_code == 200

        listed = admin.get(f"/admin/tenants/{tenant_id}/keys").json()["data"]
        assert len(listed) == 4 and all("key" not in entry for entry in listed)
        assert key not in json.dumps(listed) and second["key"] not in json.dumps(listed)
        # last_used_at is written off the request path; it arrives shortly.
        for _ in range(100):
            listed = admin.get(f"/admin/tenants/{tenant_id}/keys").json()["data"]
            if any(entry["last_used_at"] for entry in listed):
                break
            time.sleep(0.05)
        assert any(entry["last_used_at"] for entry in listed)


def _token(claims: dict, key: object, alg: str = "HS256") -> str:
    return jwt.encode({"alg": alg}, claims, key)  # type: ignore[arg-type]


def test_admin_tokens_are_refused_unless_valid_signed_current_and_scoped(
    tenancy_server: Server,
) -> None:
    server = tenancy_server
    key = OctKey.import_key(derive(TEST_SECRET.encode(), "admin-jwt"))
    now = int(time.time())
    good = {"sub": "t", "exp": now + 60, "scope": "admin"}
    unsigned = (
        ".".join(
            base64.urlsafe_b64encode(json.dumps(part).encode()).rstrip(b"=").decode()
            for part in ({"alg": "none", "typ": "JWT"}, good)
        )
        + "."
    )
    cases = {
        "none": (None, 401),
        "garbage": ("not.a.jwt", 401),
        "alg none": (unsigned, 401),
        "another key": (_token(good, OctKey.import_key(b"k" * 32)), 401),
        "expired": (_token(good | {"exp": now - 5}, key), 401),
        "no exp": (_token({"sub": "t", "scope": "admin"}, key), 401),
        "no admin scope": (_token(good | {"scope": "read"}, key), 403),
        "a tenant key": (server.tenancy.api_key, 401),
        "valid": (_token(good, key), 200),
    }
    for name, (token, status) in cases.items():
        headers = {} if token is None else {"Authorization": f"Bearer {token}"}
        resp = httpx.get(f"{server.base_url}/admin/tenants", headers=headers)
        assert resp.status_code == status, name
        if status != 200:
            assert set(resp.json()["error"]) == {"message", "type", "param", "code"}


def test_issuer_audience_and_rs256_against_a_jwks_file(tmp_path: Path) -> None:
    rsa = RSAKey.generate_key(2048, parameters={"kid": "idp-1"})
    jwks = tmp_path / "jwks.json"
    jwks.write_text(json.dumps(KeySet([rsa]).as_dict(private=False)))
    auth = AdminAuth(
        Settings(
            admin_jwt_algorithm="RS256",
            admin_jwt_jwks=str(jwks),
            admin_jwt_issuer="https://idp.example",
            admin_jwt_audience="loragate",
        )
    )
    now = int(time.time())
    claims = {"iss": "https://idp.example", "aud": "loragate", "exp": now + 60, "scope": "admin"}

    def verify(token: str) -> int:
        try:
            auth.verify(f"Bearer {token}")
        except APIError as exc:
            return exc.status
        return 200

    header = {"alg": "RS256", "kid": "idp-1"}
    assert verify(jwt.encode(header, claims, rsa)) == 200
    assert verify(jwt.encode(header, claims | {"aud": "someone-else"}, rsa)) == 401
    assert verify(jwt.encode(header, claims | {"iss": "https://evil.example"}, rsa)) == 401
    other = RSAKey.generate_key(2048, parameters={"kid": "idp-1"})
    assert verify(jwt.encode(header, claims, other)) == 401
    # An HS256 token signed with the public key's bytes (algorithm confusion) is refused.
    assert verify(_token(claims, OctKey.import_key(b"p" * 32))) == 401


def test_metrics_are_open_unless_metrics_auth(
    tenancy_server: Server, tenancy_engine: object, demo_model_dir: Path, tmp_path: Path
) -> None:
    assert httpx.get(f"{tenancy_server.base_url}/metrics").status_code == 200
    app = build_test_app(
        tenancy_engine,  # type: ignore[arg-type]
        MODEL,
        tmp_path / "guarded",
        demo_model_dir,
        settings={"metrics_auth": True},
    )
    with live_server(app, tenancy_engine) as guarded:  # type: ignore[arg-type]
        assert httpx.get(f"{guarded.base_url}/metrics").status_code == 401
        tenant = {"Authorization": f"Bearer {guarded.tenancy.api_key}"}
        assert httpx.get(f"{guarded.base_url}/metrics", headers=tenant).status_code == 401
        ok = httpx.get(f"{guarded.base_url}/metrics", headers=guarded.admin_headers)
        assert ok.status_code == 200 and "loragate:num_requests_running" in ok.text
        assert httpx.get(f"{guarded.base_url}/health").status_code == 200  # always open
