"""The console's routes: its page and static files (shipped in the package, no CDN, no build
step), and its session API (`/console/api/session`). The pages themselves call the admin REST
(/admin/...) with the session's cookie."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, ConfigDict, Field

from gateway.console import oauth
from gateway.console.session import (
    MAX_TOKEN_CHARS,
    clear_session,
    cookie_authorization,
    csrf_token,
    session_token,
    set_session,
)
from gateway.http.deps import TenancyDep
from gateway.http.edge import StrictJSONRoute
from gateway.http.error_schemas import ADMIN_ERRORS
from gateway.http.errors import APIError

STATIC = Path(__file__).parent / "static"

router = APIRouter(prefix="/console", tags=["console"], include_in_schema=False)
api = APIRouter(
    prefix="/console/api",
    tags=["console"],
    route_class=StrictJSONRoute,
    responses=ADMIN_ERRORS,
    include_in_schema=False,
)


class SignIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    token: str = Field(min_length=1, max_length=MAX_TOKEN_CHARS, description="An admin JWT.")


class SessionState(BaseModel):
    signed_in: bool
    subject: str | None = None
    expires_at: int | None = None
    csrf_token: str | None = None
    oauth: bool = Field(description="Sign-in with the identity provider is configured.")


@router.get("", response_class=FileResponse)
@router.get("/", response_class=FileResponse)
async def page() -> FileResponse:
    return FileResponse(STATIC / "index.html", media_type="text/html")


@router.get("/favicon.ico", response_class=Response)
async def favicon() -> Response:
    return Response(status_code=204)


@api.get("/session", response_model=SessionState)
async def session(request: Request, tenancy: TenancyDep, response: Response) -> dict[str, Any]:
    """Whether the cookie holds a valid admin token; if so, the CSRF token that goes with it."""
    token = session_token(request)
    if token is None:
        return _signed_out(request)
    try:
        claims = tenancy.admin.verify(f"Bearer {token}")
    except APIError:  # expired or no longer trusted: the page signs in again
        clear_session(response, request)
        return _signed_out(request)
    return _signed_in(request, tenancy.secret_key, token, claims)


@api.post("/session", response_model=SessionState)
async def sign_in(
    body: SignIn, request: Request, tenancy: TenancyDep, response: Response
) -> dict[str, Any]:
    """Sign in with an admin token: refused as the admin REST refuses it (401, 403)."""
    claims = tenancy.admin.verify(f"Bearer {body.token}")
    set_session(response, request, body.token, claims)
    return _signed_in(request, tenancy.secret_key, body.token, claims)


@api.delete("/session", status_code=204, response_class=Response)
async def sign_out(request: Request, tenancy: TenancyDep) -> Response:
    cookie_authorization(request, tenancy.secret_key)  # a cross-site sign-out needs the token too
    response = Response(status_code=204)
    clear_session(response, request)
    return response


def _signed_out(request: Request) -> dict[str, Any]:
    return {"signed_in": False, "oauth": _oauth_configured(request)}


def _signed_in(
    request: Request, secret_key: bytes, token: str, claims: dict[str, Any]
) -> dict[str, Any]:
    return {
        "signed_in": True,
        "subject": str(claims.get("sub", "")) or None,
        "expires_at": int(claims["exp"]),
        "csrf_token": csrf_token(secret_key, token),
        "oauth": _oauth_configured(request),
    }


def _oauth_configured(request: Request) -> bool:
    return getattr(request.app.state, "console_oauth", None) is not None


def install_console(app: FastAPI) -> list[Any]:
    """Serve the console on `app`; returns its routes (for the 405 Allow lists)."""
    app.mount("/console/static", StaticFiles(directory=STATIC), name="console-static")
    app.include_router(router)
    app.include_router(api)
    app.include_router(oauth.router)
    return [*router.routes, *api.routes, *oauth.router.routes]
