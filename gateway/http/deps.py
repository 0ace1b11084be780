"""The routes' dependencies, as `Annotated` aliases: `AdminDep` (a verified admin token's
claims: from the Authorization header, or from the console's cookie), the tenancy, the served
models, and an app's optional services. The tenant a /v1 request runs as is
gateway.tenancy.auth's `TenantDep`, beside the authentication it runs.

The admin token is read by gateway.tenancy.admin_auth itself; FastAPI's HTTPBearer is here only
so that the OpenAPI schema names the security scheme.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, TypeVar, cast

from fastapi import Depends, Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from gateway.console.session import cookie_authorization
from gateway.http.errors import APIError
from gateway.models.served import ServedModels
from gateway.tenancy.state import Tenancy

T = TypeVar("T")

admin_token = HTTPBearer(
    auto_error=False,
    scheme_name="AdminToken",
    bearerFormat="JWT",
    description="An OAuth2 access token (JWT) with scope `admin`.",
)


def get_tenancy(request: Request) -> Tenancy:
    return request.app.state.tenancy  # type: ignore[no-any-return]


def get_models(request: Request) -> ServedModels:
    return request.app.state.models  # type: ignore[no-any-return]


def app_service(kind: type[T], attr: str, api: str) -> Callable[[Request], T]:
    """A dependency: the app's `attr` (what the server made at start-up to serve `api`, a
    `kind`), or a 404 where this server does not serve that API."""

    def get(request: Request) -> T:
        found = getattr(request.app.state, attr, None)
        if found is None:
            raise APIError(404, f"this server does not serve the {api}", code="not_found")
        return cast(T, found)

    get.__name__ = f"get_{attr}"
    return get


def require_admin(
    request: Request, _: Annotated[HTTPAuthorizationCredentials | None, Security(admin_token)]
) -> dict[str, Any]:
    tenancy = get_tenancy(request)
    authorization = request.headers.get("authorization")
    if authorization is None:  # the console's cookie, with its CSRF rule (gateway/console)
        authorization = cookie_authorization(request, tenancy.secret_key)
    return tenancy.admin.verify(authorization)


AdminDep = Annotated[dict[str, Any], Depends(require_admin)]
TenancyDep = Annotated[Tenancy, Depends(get_tenancy)]
ModelsDep = Annotated[ServedModels, Depends(get_models)]
