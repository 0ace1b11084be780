"""The Batch API's request body, bounded at the edge, and its objects as the openai SDK types
them (openai.types.Batch, a cursor page of batches), built from the store's StoredBatch; the
400 a file whose lines cannot run in the batch gets, with the lines listed as OpenAI's
BatchError."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from gateway.http.errors import APIError
from gateway.openai.batch_lines import MAX_REPORTED, BatchURL, LineError
from gateway.openai.files.protocol import LineErrorDetail
from gateway.openai.protocol import _Body
from gateway.openai.responses.protocol import Metadata
from tenants.batches import MOMENTS, StoredBatch

COMPLETION_WINDOW = "24h"  # the one value OpenAI takes
MAX_ID_CHARS = 64  # a batch's or a file's id
INVALID_BATCH_FILE = "invalid_file"


class OutputExpiresAfter(BaseModel):
    """Accepted as OpenAI's SDK sends it; a batch's files are kept until deleted here."""

    anchor: Literal["created_at"]
    seconds: int = Field(ge=3600, le=2_592_000)


class BatchCreate(_Body):
    input_file_id: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    endpoint: BatchURL
    completion_window: Literal["24h"]
    metadata: Metadata | None = None
    output_expires_after: OutputExpiresAfter | None = None


# The answers, for the OpenAPI schema (the routes return the bodies below as dicts).


class RequestCounts(BaseModel):
    total: int
    completed: int = Field(description="Lines answered (in the output file).")
    failed: int = Field(description="Lines refused or expired (in the error file).")


class InputTokensDetails(BaseModel):
    cached_tokens: int


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int


class BatchUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class BatchErrors(BaseModel):
    object: Literal["list"]
    data: list[LineErrorDetail]


class BatchObject(BaseModel):
    id: str
    object: Literal["batch"]
    endpoint: str
    model: str | None
    errors: BatchErrors | None
    input_file_id: str
    completion_window: str
    status: Literal[
        "validating",
        "failed",
        "in_progress",
        "finalizing",
        "completed",
        "expired",
        "cancelling",
        "cancelled",
    ]
    output_file_id: str | None
    error_file_id: str | None
    created_at: int
    in_progress_at: int | None
    expires_at: int | None
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    expired_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    request_counts: RequestCounts
    metadata: dict[str, str] | None
    usage: BatchUsage


class BatchList(BaseModel):
    object: Literal["list"]
    data: list[BatchObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


def batch_object(batch: StoredBatch) -> dict[str, Any]:
    """The batch as OpenAI shows it: times in Unix seconds, its counts and token usage (its
    lines' so far while it runs)."""
    t = batch.totals
    moments = {
        name: None if moment is None else int(moment.timestamp())
        for name, moment in batch.moments.items()
    }
    return {
        "id": batch.id,
        "object": "batch",
        "endpoint": batch.endpoint,
        "model": None,
        "errors": None,
        "input_file_id": batch.input_file_id,
        "completion_window": batch.completion_window,
        "status": batch.status,
        "output_file_id": batch.output_file_id,
        "error_file_id": batch.error_file_id,
        "created_at": int(batch.created_at.timestamp()),
        "expires_at": int(batch.expires_at.timestamp()),
        **{name: moments.get(name) for name in MOMENTS},
        "request_counts": {"total": t.total, "completed": t.completed, "failed": t.failed},
        "metadata": batch.metadata,
        "usage": {
            "input_tokens": t.prompt_tokens,
            "input_tokens_details": {"cached_tokens": t.cached_tokens},
            "output_tokens": t.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": t.prompt_tokens + t.completion_tokens,
        },
    }


def batch_list(batches: list[StoredBatch], has_more: bool) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [batch_object(batch) for batch in batches],
        "first_id": batches[0].id if batches else None,
        "last_id": batches[-1].id if batches else None,
        "has_more": has_more,
    }


class BatchFileRefused(APIError):
    """400 for an input file with lines that cannot run in this batch (a url other than its
    endpoint, a body the route now refuses): the first ones in the message (`line N: why`)
    and, as OpenAI's BatchError, under the error's `lines`."""

    def __init__(self, errors: list[LineError], num_bad: int) -> None:
        listed = "; ".join(str(error) for error in errors[:MAX_REPORTED])
        more = num_bad - min(len(errors), MAX_REPORTED)
        tail = f"; and {more} more" if more else ""
        bad = "1 line" if num_bad == 1 else f"{num_bad} lines"
        super().__init__(
            400,
            f"the input file has {bad} this batch cannot run: {listed}{tail}",
            param="input_file_id",
            code=INVALID_BATCH_FILE,
        )
        self.lines = [error.body() for error in errors[:MAX_REPORTED]]

    def body(self) -> dict[str, Any]:
        body = super().body()
        body["error"]["lines"] = self.lines
        return body
