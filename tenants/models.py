"""The tenancy tables (SQLAlchemy 2): tenants, their API keys, adapters, the usage ledger, the
stored responses of the Responses API, the conversations of the Conversations API, the files of
the Files API, and the batches of the Batch API with their lines.

Alembic owns the schema (migrations/); the app never calls `create_all` outside tests, and
a test holds the models and the migrations to each other. Ids are short random strings with
a prefix that says what they name (`ten_`, `key_`, `ad_`).
"""

from __future__ import annotations

import secrets
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Dialect,
    ForeignKey,
    Index,
    String,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

TENANT_ACTIVE, TENANT_SUSPENDED = "active", "suspended"
USAGE_STATUSES = ("ok", "aborted", "error")
RESPONSE_STATUSES = ("queued", "in_progress", "completed", "failed", "cancelled", "incomplete")
# OpenAI's batch statuses; a line's: waiting, claimed by a gateway, answered (done) or refused
# (failed), or never run (the batch was cancelled or expired first).
BATCH_STATUSES = (
    "validating",
    "in_progress",
    "finalizing",
    "completed",
    "failed",
    "expired",
    "cancelling",
    "cancelled",
)
LINE_STATUSES = ("pending", "running", "done", "failed", "cancelled", "expired")
PUBLIC_SCOPE = "public"  # an adapter every tenant may use


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def utcnow() -> datetime:
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """A timezone-aware timestamp on every database, UTC where none is given: a naive value
    going in is taken as UTC, and SQLite's naive values coming out are UTC."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is not None and value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is not None and value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value


class Base(DeclarativeBase):
    type_annotation_map = {datetime: UTCDateTime, dict[str, Any]: JSON}


class Tenant(Base):
    __tablename__ = "tenants"

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=lambda: new_id("ten"))
    name: Mapped[str] = mapped_column(String(64), unique=True)
    status: Mapped[str] = mapped_column(String(16), default=TENANT_ACTIVE)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    # The scheduler's share of the batch under contention (tenancy part 2).
    weight: Mapped[float] = mapped_column(default=1.0)
    # Tenants of one cache group share prefix-cache blocks; None: the tenant's own.
    cache_group: Mapped[str | None] = mapped_column(String(64))
    # Limits (tenancy part 2); None: unlimited.
    rpm_limit: Mapped[int | None] = mapped_column(BigInteger)
    tpm_limit: Mapped[int | None] = mapped_column(BigInteger)
    max_concurrency: Mapped[int | None] = mapped_column(BigInteger)
    monthly_token_quota: Mapped[int | None] = mapped_column(BigInteger)
    # The served models (by name) the tenant may use; None: every model.
    allowed_models: Mapped[list[str] | None] = mapped_column(JSON(none_as_null=True))
    # Tokens (estimated: prompt + max_tokens per line) the tenant's unfinished batches may
    # hold at once; None: the server's --batch-token-limit.
    batch_token_limit: Mapped[int | None] = mapped_column(BigInteger)


class ApiKey(Base):
    """A tenant's key: only its visible prefix and the sha256 of the whole key are kept."""

    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=lambda: new_id("key"))
    tenant_id: Mapped[str] = mapped_column(
        String(32), ForeignKey("tenants.id", ondelete="CASCADE"), index=True
    )
    name: Mapped[str | None] = mapped_column(String(64))
    prefix: Mapped[str] = mapped_column(String(16), index=True)
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    last_used_at: Mapped[datetime | None]
    expires_at: Mapped[datetime | None]
    revoked_at: Mapped[datetime | None]


class Adapter(Base):
    """A LoRA adapter: its metadata here, its files in the content-addressed adapter store
    (adapters/store.py) under `sha256`."""

    __tablename__ = "adapters"
    # One name per owner and base model: two base models may each have an adapter `sql`.
    __table_args__ = (
        UniqueConstraint("scope", "base_model", "name", name="uq_adapters_scope_base_model_name"),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=lambda: new_id("ad"))
    # NULL: public. `scope` repeats it as a value a unique constraint can hold (SQL's NULLs
    # are all distinct): the owner's id, or PUBLIC_SCOPE.
    owner_id: Mapped[str | None] = mapped_column(
        String(32), ForeignKey("tenants.id", ondelete="CASCADE"), index=True
    )
    scope: Mapped[str] = mapped_column(String(32))
    name: Mapped[str] = mapped_column(String(128))
    # The served model's name (the `model` clients send for it) the adapter was checked against.
    base_model: Mapped[str] = mapped_column(String(256))
    rank: Mapped[int]
    alpha: Mapped[float]
    target_modules: Mapped[list[str]] = mapped_column(JSON)
    sha256: Mapped[str] = mapped_column(String(64), index=True)
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    storage_path: Mapped[str] = mapped_column(String(512))
    status: Mapped[str] = mapped_column(String(16), default="ready")
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Usage(Base):
    """One row per request, append-only: what billing sums. Written by the ledger
    (tenants/ledger.py) from its spool, insert-or-ignore on `request_id`, so a replayed spool
    segment never counts a request twice.

    No foreign keys: a billing row outlives the tenant, key or adapter it names (deleting a
    tenant must not delete, or be blocked by, what it owes).

    `created_epoch` repeats `created_at` as whole Unix seconds (UTC). Buckets of a minute, an
    hour or a day are then integer arithmetic (`created_epoch - created_epoch % 3600`) that
    SQLite and PostgreSQL compute alike and an index serves, where `created_at` would need
    date_trunc on one and strftime over a text column on the other.
    """

    __tablename__ = "usage"
    # The sums ride along in the tenant's index on PostgreSQL (0005): a tenant's sums and a
    # page of tenants' month tokens are read from the index alone. 0005 also gives PostgreSQL
    # statistics on the day bucket (`usage_created_day`), which metadata cannot express.
    __table_args__ = (
        Index(
            "ix_usage_tenant_id_created_epoch",
            "tenant_id",
            "created_epoch",
            postgresql_include=["prompt_tokens", "cached_tokens", "completion_tokens"],
        ),
        Index("ix_usage_created_epoch", "created_epoch"),
    )

    request_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(String(32))
    key_id: Mapped[str | None] = mapped_column(String(32))
    model: Mapped[str] = mapped_column(String(256))
    adapter_name: Mapped[str | None] = mapped_column(String(128))
    adapter_sha256: Mapped[str | None] = mapped_column(String(64))
    prompt_tokens: Mapped[int]
    cached_tokens: Mapped[int]
    completion_tokens: Mapped[int]
    finish_reason: Mapped[str | None] = mapped_column(String(32))
    status: Mapped[str] = mapped_column(String(16))  # USAGE_STATUSES
    ttft: Mapped[float | None]  # seconds to the first token; None: none came
    latency: Mapped[float]  # seconds, arrival to the last byte (or the abort)
    created_at: Mapped[datetime]
    created_epoch: Mapped[int] = mapped_column(BigInteger)
    # The API the request came through ("completions", "chat", "responses", "batch");
    # None: written before 0004 recorded it.
    endpoint: Mapped[str | None] = mapped_column(String(32))
    # The batch a line of which this request was (endpoint "batch"); None: not a batch's.
    batch_id: Mapped[str | None] = mapped_column(String(64), index=True)


class StoredResponseRow(Base):
    """A response of the Responses API stored for a tenant (`store: true`), to be retrieved,
    continued from (`previous_response_id`), listed as input items, or cancelled while it runs
    in the background. Read and written by tenants/responses.py; deleted when it expires (the
    sweep), when the tenant holds more than its cap, or with the tenant (ON DELETE CASCADE,
    which SQLite enforces only when asked to).

    `previous_response_id` has no foreign key: the previous response may expire, or be
    deleted, before the ones that continue it.
    """

    __tablename__ = "responses"
    __table_args__ = (Index("ix_responses_tenant_id_created_at", "tenant_id", "created_at"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)  # resp_<32 hex>
    tenant_id: Mapped[str] = mapped_column(
        String(32), ForeignKey("tenants.id", ondelete="CASCADE"), index=True
    )
    key_id: Mapped[str | None] = mapped_column(String(32))
    model: Mapped[str] = mapped_column(String(255))
    status: Mapped[str] = mapped_column(String(16))  # RESPONSE_STATUSES
    background: Mapped[bool] = mapped_column(Boolean)
    previous_response_id: Mapped[str | None] = mapped_column(String(64))
    input_items: Mapped[list[dict[str, Any]]] = mapped_column(JSON)  # this turn's input
    output: Mapped[list[dict[str, Any]]] = mapped_column(JSON)  # the output items
    body: Mapped[dict[str, Any]] = mapped_column(JSON)  # the object as last returned
    created_at: Mapped[datetime]
    expires_at: Mapped[datetime] = mapped_column(index=True)
    # When the gateway running it last said so (each save, and a beat while in background).
    heartbeat_at: Mapped[datetime]


class ConversationRow(Base):
    """A conversation of the Conversations API (`/v1/conversations`): its items are
    ConversationItemRow, in order. Read and written by tenants/conversations.py; deleted when
    it expires (the sweep; every write moves `expires_at` on), when the tenant holds more than
    its cap, or with the tenant (ON DELETE CASCADE, by hand where SQLite does not enforce it).
    """

    __tablename__ = "conversations"
    # The cap deletes a tenant's least recently written first: by expires_at.
    __table_args__ = (Index("ix_conversations_tenant_id_expires_at", "tenant_id", "expires_at"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)  # conv_<32 hex>
    tenant_id: Mapped[str] = mapped_column(
        String(32), ForeignKey("tenants.id", ondelete="CASCADE"), index=True
    )
    key_id: Mapped[str | None] = mapped_column(String(32))
    # `metadata` is the declarative base's own attribute: the column keeps the API's name.
    meta: Mapped[dict[str, str]] = mapped_column("metadata", JSON)
    # Positions handed out so far: the next item's position. Items deleted leave gaps.
    next_position: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime]
    expires_at: Mapped[datetime] = mapped_column(index=True)


class ConversationItemRow(Base):
    """An item of a conversation (a message, a function call or its output, in the Responses
    API's shape with its id), at its position: items list in position order. An item id is
    unique within its conversation."""

    __tablename__ = "conversation_items"
    __table_args__ = (
        UniqueConstraint(
            "conversation_id", "item_id", name="uq_conversation_items_conversation_id_item_id"
        ),
    )

    conversation_id: Mapped[str] = mapped_column(
        String(64), ForeignKey("conversations.id", ondelete="CASCADE"), primary_key=True
    )
    position: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    item_id: Mapped[str] = mapped_column(String(64))
    item: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_at: Mapped[datetime]


class FileRow(Base):
    """A file of the Files API (`/v1/files`): its bytes are on disk (tenants/files.py, under
    the adapter store's root), this row says whose they are and what they are for. `purpose`
    is `batch` for a client's upload, `batch_output` for what a batch wrote. Deleted through
    the API, or with the tenant (ON DELETE CASCADE, by hand where SQLite does not enforce it).
    """

    __tablename__ = "files"
    # A tenant's files listed by creation: by (tenant_id, created_at).
    __table_args__ = (Index("ix_files_tenant_id_created_at", "tenant_id", "created_at"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)  # file-<32 hex>
    tenant_id: Mapped[str] = mapped_column(
        String(32), ForeignKey("tenants.id", ondelete="CASCADE"), index=True
    )
    purpose: Mapped[str] = mapped_column(String(32))
    filename: Mapped[str] = mapped_column(String(255))
    num_bytes: Mapped[int] = mapped_column("bytes", BigInteger)
    num_lines: Mapped[int] = mapped_column("lines", BigInteger)
    created_at: Mapped[datetime]


class BatchRow(Base):
    """A batch of the Batch API (`/v1/batches`): its lines are BatchLineRow. Read and written
    by tenants/batches.py and tenants/batch_lines.py; deleted with the tenant (ON DELETE
    CASCADE, by hand where SQLite does not enforce it).

    `finisher` and `finish_until` are the claim on its finalization (writing its output and
    error files, its counts and last status): whoever sets them first, or after they lapsed,
    finalizes it, once. The counts and usage sums are written then; while it runs they are
    read from its lines.
    """

    __tablename__ = "batches"
    __table_args__ = (Index("ix_batches_tenant_id_created_at", "tenant_id", "created_at"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)  # batch_<32 hex>
    tenant_id: Mapped[str] = mapped_column(
        String(32), ForeignKey("tenants.id", ondelete="CASCADE"), index=True
    )
    key_id: Mapped[str | None] = mapped_column(String(32))
    endpoint: Mapped[str] = mapped_column(String(32))  # the url every line names
    input_file_id: Mapped[str] = mapped_column(String(64))
    completion_window: Mapped[str] = mapped_column(String(8))
    status: Mapped[str] = mapped_column(String(16), index=True)  # BATCH_STATUSES
    # `metadata` is the declarative base's own attribute: the column keeps the API's name.
    meta: Mapped[dict[str, str]] = mapped_column("metadata", JSON)
    output_file_id: Mapped[str | None] = mapped_column(String(64))
    error_file_id: Mapped[str | None] = mapped_column(String(64))
    num_total: Mapped[int] = mapped_column(BigInteger)
    num_completed: Mapped[int] = mapped_column(BigInteger, default=0)
    num_failed: Mapped[int] = mapped_column(BigInteger, default=0)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    cached_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    completion_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    created_at: Mapped[datetime]
    in_progress_at: Mapped[datetime | None]
    expires_at: Mapped[datetime]
    finalizing_at: Mapped[datetime | None]
    completed_at: Mapped[datetime | None]
    failed_at: Mapped[datetime | None]
    expired_at: Mapped[datetime | None]
    cancelling_at: Mapped[datetime | None]
    cancelled_at: Mapped[datetime | None]
    finisher: Mapped[str | None] = mapped_column(String(64))
    finish_until: Mapped[datetime | None]


class BatchLineRow(Base):
    """A line of a batch's input file: its request, its state, and once answered its output
    line (OpenAI's shape) and usage figures. A gateway claims a line (`claimed_by`, until
    `lease_until`, renewed while it runs); its answer is written with the line's usage row in
    one transaction, only while the claim is still the writer's."""

    __tablename__ = "batch_lines"
    # Claims look for a batch's lines by status, in order.
    __table_args__ = (Index("ix_batch_lines_batch_id_status_line", "batch_id", "status", "line"),)

    batch_id: Mapped[str] = mapped_column(
        String(64), ForeignKey("batches.id", ondelete="CASCADE"), primary_key=True
    )
    line: Mapped[int] = mapped_column(BigInteger, primary_key=True)  # 1-based, in the file
    custom_id: Mapped[str] = mapped_column(String(512))
    body: Mapped[dict[str, Any]] = mapped_column(JSON)  # the request's body
    # Prompt + max_tokens (what the route reserves): what the queued-token cap counts.
    estimated_tokens: Mapped[int] = mapped_column(BigInteger)
    status: Mapped[str] = mapped_column(String(16))  # LINE_STATUSES
    claimed_by: Mapped[str | None] = mapped_column(String(64))
    lease_until: Mapped[datetime | None]
    # Claims of it not given back (their gateway stopped with it, or answered it).
    attempts: Mapped[int] = mapped_column(BigInteger, default=0)
    # The output line ({"id", "custom_id", "response", "error"}), once done or failed.
    result: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True))
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    cached_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    completion_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    finished_at: Mapped[datetime | None]
