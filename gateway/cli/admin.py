"""Operators' commands, for when no admin token is at hand: `loragate db`, `tenants`, `keys`
and `admin token`. Each reads the same settings as `serve` (LORAGATE_* variables, and
`--database-url` where it matters), so they act on the server's database and sign tokens the
server accepts.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable
from typing import Annotated, TypeVar

import typer

from gateway.settings import Settings, SettingsError

T = TypeVar("T")

db_app = typer.Typer(no_args_is_help=True, help="The database schema (alembic migrations).")
tenants_app = typer.Typer(no_args_is_help=True, help="Tenants.")
keys_app = typer.Typer(no_args_is_help=True, help="Tenants' API keys.")
admin_app = typer.Typer(no_args_is_help=True, help="Admin tokens for the /admin REST API.")

DatabaseURL = Annotated[
    str | None,
    typer.Option(help="Default: LORAGATE_DATABASE_URL, else sqlite+aiosqlite:///./loragate.db."),
]


def register(app: typer.Typer) -> None:
    app.add_typer(db_app, name="db")
    app.add_typer(tenants_app, name="tenants")
    app.add_typer(keys_app, name="keys")
    app.add_typer(admin_app, name="admin")


def _settings(database_url: str | None) -> Settings:
    return Settings() if database_url is None else Settings(database_url=database_url)


def _with_db(database_url: str | None, work: Callable[..., Awaitable[T]]) -> T:
    """Migrate (as serve does unless told not to), then run `work(session)` in one
    transaction."""
    from tenants.db import Database, upgrade

    settings = _settings(database_url)
    if settings.db_upgrade:
        upgrade(settings.database_url)

    async def run() -> T:
        db = Database(settings.database_url)
        try:
            async with db.session() as session, session.begin():
                return await work(session)
        finally:
            await db.close()

    return asyncio.run(run())


@db_app.command("upgrade")
def db_upgrade(
    revision: Annotated[str, typer.Argument(help="Target revision.")] = "head",
    database_url: DatabaseURL = None,
) -> None:
    """Migrate the database to a revision (default: the latest)."""
    from tenants.db import current_revision, upgrade

    url = _settings(database_url).database_url
    upgrade(url, revision)
    typer.echo(f"database at revision {current_revision(url)}")


@db_app.command("downgrade")
def db_downgrade(
    revision: Annotated[str, typer.Argument(help="Target revision; `base` empties it.")],
    database_url: DatabaseURL = None,
) -> None:
    """Migrate the database back to a revision."""
    from tenants.db import current_revision, downgrade

    url = _settings(database_url).database_url
    downgrade(url, revision)
    typer.echo(f"database at revision {current_revision(url) or 'base'}")


@tenants_app.command("create")
def tenants_create(
    name: str,
    weight: Annotated[float, typer.Option(help="Share of the batch under contention.")] = 1.0,
    cache_group: Annotated[str | None, typer.Option(help="Share prefix-cache blocks.")] = None,
    rpm_limit: Annotated[int | None, typer.Option(min=1, help="Requests per minute.")] = None,
    tpm_limit: Annotated[int | None, typer.Option(min=1, help="Tokens per minute.")] = None,
    max_concurrency: Annotated[int | None, typer.Option(min=1, help="In flight.")] = None,
    monthly_token_quota: Annotated[
        int | None, typer.Option(min=0, help="Tokens per calendar month (UTC).")
    ] = None,
    batch_token_limit: Annotated[
        int | None,
        typer.Option(
            min=0,
            help="Tokens its unfinished batches may hold. Default: the server's "
            "--batch-token-limit.",
        ),
    ] = None,
    allowed_model: Annotated[
        list[str] | None,
        typer.Option(help="A base model it may use (repeat for more). Default: every model."),
    ] = None,
    database_url: DatabaseURL = None,
) -> None:
    """Create a tenant; prints its id. A limit not given is the server's default
    (LORAGATE_DEFAULT_RPM_LIMIT, ...), else unlimited."""
    import re

    from gateway.models.models_file import MODEL_NAME_PATTERN
    from tenants.tenants import TenantExists, create_tenant

    for model in allowed_model or ():
        if not re.fullmatch(MODEL_NAME_PATTERN, model):
            raise typer.BadParameter(f"{model!r} is not a model name", param_hint="--allowed-model")

    settings = _settings(database_url)
    limits = {
        "rpm_limit": rpm_limit or settings.default_rpm_limit,
        "tpm_limit": tpm_limit or settings.default_tpm_limit,
        "max_concurrency": max_concurrency or settings.default_max_concurrency,
        "monthly_token_quota": (
            settings.default_monthly_token_quota
            if monthly_token_quota is None
            else monthly_token_quota
        ),
    }

    async def work(session):  # type: ignore[no-untyped-def]
        tenant = await create_tenant(
            session,
            name=name,
            weight=weight,
            cache_group=cache_group,
            allowed_models=list(dict.fromkeys(allowed_model)) if allowed_model else None,
            batch_token_limit=batch_token_limit,
            **limits,
        )
        return tenant.id

    try:
        typer.echo(_with_db(database_url, work))
    except (TenantExists, ValueError) as exc:
        raise typer.BadParameter(str(exc), param_hint="NAME") from exc


@tenants_app.command("list")
def tenants_list(database_url: DatabaseURL = None) -> None:
    """Tenants, one a line: id, name, status."""
    from tenants.tenants import list_tenants

    async def work(session):  # type: ignore[no-untyped-def]
        return [(t.id, t.name, t.status) for t in await list_tenants(session)]

    for row in _with_db(database_url, work):
        typer.echo("\t".join(row))


@keys_app.command("create")
def keys_create(
    tenant: Annotated[str, typer.Argument(help="The tenant's name or id.")],
    name: Annotated[str | None, typer.Option(help="What the key is for.")] = None,
    database_url: DatabaseURL = None,
) -> None:
    """Create an API key; prints it, the only time it is shown."""
    from tenants.keys import create_key
    from tenants.tenants import get_tenant, get_tenant_by_name

    async def work(session):  # type: ignore[no-untyped-def]
        found = await get_tenant_by_name(session, name=tenant) or await get_tenant(
            session, tenant_id=tenant
        )
        if found is None:
            return None
        return (await create_key(session, tenant_id=found.id, name=name))[1]

    key = _with_db(database_url, work)
    if key is None:
        raise typer.BadParameter("no such tenant", param_hint="TENANT")
    typer.echo(key)


@admin_app.command("token")
def admin_token(
    ttl: Annotated[str, typer.Option(help="Lifetime: 90s, 30m, 1h, 7d.")] = "1h",
    subject: Annotated[str, typer.Option(help="The token's `sub`.")] = "loragate-cli",
) -> None:
    """Mint an HS256 admin token with the server's settings; prints only the token."""
    from gateway.tenancy.admin_auth import mint_admin_token

    try:
        token = mint_admin_token(Settings(), _seconds(ttl), subject)
    except (SettingsError, ValueError) as exc:
        raise typer.BadParameter(str(exc)) from exc
    typer.echo(token)


def _seconds(text: str) -> int:
    match = re.fullmatch(r"(\d+)([smhd]?)", text.strip())
    if match is None or int(match.group(1)) == 0:
        raise typer.BadParameter("a lifetime like 90s, 30m, 1h or 7d", param_hint="--ttl")
    return int(match.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[match.group(2)]
