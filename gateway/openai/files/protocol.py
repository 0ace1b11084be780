"""The Files API's objects as the openai SDK types them (openai.types.FileObject, FileDeleted,
a cursor page of files), the upload's multipart form for the OpenAPI schema, and the 400 a file
with bad lines gets: OpenAI's error with the lines listed (openai.types.BatchError's shape)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from gateway.http.error_schemas import ErrorDetail
from gateway.http.errors import APIError
from gateway.openai.batch_lines import MAX_REPORTED, FileCheck
from tenants.files import MAX_FILENAME_CHARS, FilePage, FileRecord

UPLOAD_PURPOSE = "batch"  # the one purpose a client uploads here
INVALID_FILE = "invalid_file"

# The upload (multipart/form-data), as OpenAI's: `file` and `purpose`.
UPLOAD_BODY: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["file", "purpose"],
                    "properties": {
                        "file": {
                            "type": "string",
                            "format": "binary",
                            "description": "JSONL, one batch request a line: custom_id, method "
                            "POST, url (/v1/chat/completions, /v1/completions, /v1/responses) "
                            f"and body; its name at most {MAX_FILENAME_CHARS} characters.",
                        },
                        "purpose": {
                            "type": "string",
                            "enum": [UPLOAD_PURPOSE],
                            "description": "`batch`: the Batch API's input, the one purpose "
                            "this server takes.",
                        },
                    },
                }
            }
        },
    }
}


class FileObject(BaseModel):
    id: str
    object: Literal["file"]
    bytes: int
    created_at: int
    expires_at: int | None = Field(description="Files are kept until deleted: null.")
    filename: str
    purpose: Literal["batch", "batch_output"] = Field(
        description="`batch`: uploaded; `batch_output`: a batch's output or error file."
    )
    status: Literal["processed"]
    status_details: str | None


class FileList(BaseModel):
    object: Literal["list"]
    data: list[FileObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"]
    deleted: bool


class LineErrorDetail(BaseModel):
    line: int = Field(description="The line's number in the file, from 1.")
    code: str
    message: str
    param: str | None


class InvalidFileDetail(ErrorDetail):
    lines: list[LineErrorDetail] = Field(
        default=[], description=f"The first {MAX_REPORTED} bad lines (`invalid_file`)."
    )


class InvalidFileBody(BaseModel):
    error: InvalidFileDetail


class InvalidFile(APIError):
    """400 for a file with bad lines: the first ones in the message (`line N: why`) and, in
    OpenAI's BatchError shape, under the error's `lines`."""

    def __init__(self, check: FileCheck) -> None:
        listed = "; ".join(str(error) for error in check.errors)
        more = check.num_bad - len(check.errors)
        tail = f"; and {more} more" if more else ""
        bad = "1 line" if check.num_bad == 1 else f"{check.num_bad} lines"
        super().__init__(
            400,
            f"the file has {bad} its route would refuse, nothing was stored: {listed}{tail}",
            param="file",
            code=INVALID_FILE,
        )
        self.lines = [error.body() for error in check.errors]

    def body(self) -> dict[str, Any]:
        body = super().body()
        body["error"]["lines"] = self.lines
        return body


def file_object(record: FileRecord) -> dict[str, Any]:
    return {
        "id": record.id,
        "object": "file",
        "bytes": record.bytes,
        "created_at": int(record.created_at.timestamp()),
        "expires_at": None,
        "filename": record.filename,
        "purpose": record.purpose,
        "status": "processed",
        "status_details": None,
    }


def file_list(page: FilePage) -> dict[str, Any]:
    files = page.files
    return {
        "object": "list",
        "data": [file_object(record) for record in files],
        "first_id": files[0].id if files else None,
        "last_id": files[-1].id if files else None,
        "has_more": page.has_more,
    }
