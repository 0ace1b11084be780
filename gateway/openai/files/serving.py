"""The Files API over the tenant's stored files (tenants.files.FileStore).

An upload is a batch's input: its form parsed by Starlette (a part past 1 MiB spooled to a
temporary file, not held in memory), its bytes copied into the store's staging area, every line
checked as its route would check it (gateway.openai.batch_lines.check_file, a few files at a
time: tokenizing is CPU), and only a file whose every line passes is stored. A file with bad
lines is refused whole, 400 `invalid_file`, listing the first of them by number; one over the
size or line limit is a 413; nothing of a refused upload stays.

A file is the tenant's alone: another tenant's file id answers exactly as one that never
existed (404), on every route.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Literal
from urllib.parse import quote

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.datastructures import FormData, UploadFile

from gateway.http.errors import APIError
from gateway.http.request_limits import INVALID_VALUE
from gateway.openai.batch_lines import check_file
from gateway.openai.files.protocol import (
    UPLOAD_PURPOSE,
    InvalidFile,
    file_list,
    file_object,
)
from gateway.openai.responses.serving import ResponsesServing
from gateway.openai.serving import OpenAIServing
from gateway.tenancy.auth import RequestTenant
from tenants.files import MAX_FILENAME_CHARS, FileStore, TooManyFiles, read_lines

CHECKS_AT_ONCE = 2  # uploads whose lines are checked at the same time (the rest wait)
MAX_FIELDS = 4  # text parts: purpose, and expires_after[...] to be refused by name
MAX_FIELD_BYTES = 1 << 10
COPY_BLOCK = 1 << 20


@dataclass(frozen=True, slots=True)
class FileLimits:
    max_bytes: int = 200 << 20  # a file's (OpenAI's)
    max_lines: int = 50_000  # a file's requests (OpenAI's)
    max_line_bytes: int | None = None  # a line's body: the server's request bodies' limit


def not_found(file_id: str) -> APIError:
    """The one answer for a file that does not exist, or is another tenant's."""
    return APIError(404, f"No such File object: {file_id}", param="file_id", code="file_not_found")


class FilesServing:
    def __init__(
        self,
        core: OpenAIServing,
        store: FileStore,
        limits: FileLimits,
        responses: ResponsesServing | None = None,
    ) -> None:
        self.core = core
        self.store = store
        self.limits = limits
        self.responses = responses
        self._checking = asyncio.Semaphore(CHECKS_AT_ONCE)

    # -- POST /v1/files -----------------------------------------------------------------------

    async def upload(self, request: Request, tenant: RequestTenant) -> dict[str, Any]:
        content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if content_type != "multipart/form-data":
            raise APIError(415, "send the file as multipart/form-data (file, purpose)")
        form = await request.form(max_files=1, max_fields=MAX_FIELDS, max_part_size=MAX_FIELD_BYTES)
        try:
            upload = _upload(form)
            filename = upload.filename or "upload"
            if len(filename) > MAX_FILENAME_CHARS:
                raise APIError(
                    400,
                    f"file: its name is longer than {MAX_FILENAME_CHARS} characters",
                    param="file",
                    code=INVALID_VALUE,
                )
            return await self._store(tenant, upload, filename)
        finally:
            await form.close()

    async def _store(
        self, tenant: RequestTenant, upload: UploadFile, filename: str
    ) -> dict[str, Any]:
        limits = self.limits
        if upload.size is not None and upload.size > limits.max_bytes:
            raise _too_large(f"the file exceeds {limits.max_bytes} bytes")
        if await self.store.count(tenant.id) >= self.store.max_per_tenant:
            raise _too_many(self.store.max_per_tenant)
        async with self._checking:
            staged = self.store.staging()
            try:
                size, num_lines = await asyncio.to_thread(_copy, upload.file, staged)
                if size > limits.max_bytes:
                    raise _too_large(f"the file exceeds {limits.max_bytes} bytes")
                if size == 0:
                    raise APIError(400, "the file is empty", param="file", code="empty_file")
                if num_lines > limits.max_lines:
                    raise _too_large(
                        f"the file has {num_lines} lines; a batch's file may have "
                        f"{limits.max_lines}"
                    )
                check = await check_file(
                    self.core,
                    tenant,
                    read_lines(staged, max_line_bytes=limits.max_line_bytes),
                    responses=self.responses,
                    max_line_bytes=limits.max_line_bytes,
                )
                if not check.ok:
                    raise InvalidFile(check)
                record = await self.store.commit(tenant.id, UPLOAD_PURPOSE, filename, staged)
            except TooManyFiles as exc:
                raise _too_many(exc.max_per_tenant) from exc
            finally:
                self.store.discard(staged)  # gone already once committed
        return file_object(record)

    # -- the others ---------------------------------------------------------------------------

    async def list(
        self,
        tenant: RequestTenant,
        purpose: str | None,
        limit: int,
        order: Literal["asc", "desc"],
        after: str | None,
    ) -> dict[str, Any]:
        page = await self.store.list(
            tenant.id, purpose=purpose, limit=limit, after=after, order=order
        )
        return file_list(page)

    async def retrieve(self, tenant: RequestTenant, file_id: str) -> dict[str, Any]:
        record = await self.store.get(tenant.id, file_id)
        if record is None:
            raise not_found(file_id)
        return file_object(record)

    async def content(self, tenant: RequestTenant, file_id: str) -> Response:
        """The bytes as they were stored, streamed from the open file (a delete meanwhile
        does not cut the download short)."""
        opened = await self.store.open(tenant.id, file_id)
        if opened is None:
            raise not_found(file_id)
        record, stream = opened
        return StreamingResponse(
            _chunks(stream),
            media_type="application/octet-stream",
            headers={
                "content-length": str(record.bytes),
                "content-disposition": _attachment(record.filename),
            },
        )

    async def delete(self, tenant: RequestTenant, file_id: str) -> dict[str, Any]:
        if not await self.store.delete(tenant.id, file_id):
            raise not_found(file_id)
        return {"id": file_id, "object": "file", "deleted": True}


def _upload(form: FormData) -> UploadFile:
    """The form's file, once its purpose is `batch`; 400 naming the field otherwise."""
    for name in form:
        param = name.partition("[")[0]
        if param == "expires_after":
            raise APIError(
                400,
                "expires_after: not taken here; files are kept until deleted",
                param=param,
                code=INVALID_VALUE,
            )
        if name not in ("file", "purpose"):
            raise APIError(400, f"{param}: unknown parameter", param=param, code=INVALID_VALUE)
    purpose = form.get("purpose")
    if not isinstance(purpose, str):
        raise APIError(400, "purpose: a text field, batch, is required", param="purpose")
    if purpose != UPLOAD_PURPOSE:
        raise APIError(
            400,
            f"purpose: only {UPLOAD_PURPOSE!r} files are uploaded here, not {purpose!r}",
            param="purpose",
            code=INVALID_VALUE,
        )
    upload = form.get("file")
    if not isinstance(upload, UploadFile):
        raise APIError(400, "file: a file part named file is required", param="file")
    return upload


def _copy(source: IO[bytes], target: Path) -> tuple[int, int]:
    """The upload's bytes into the staging area; their size and number of lines."""
    source.seek(0)
    size = num_lines = 0
    last = b"\n"
    with target.open("wb") as out:
        while chunk := source.read(COPY_BLOCK):
            out.write(chunk)
            size += len(chunk)
            num_lines += chunk.count(b"\n")
            last = chunk[-1:]
    return size, num_lines + (last != b"\n")


def _chunks(stream: IO[bytes]) -> Iterator[bytes]:
    with stream:
        while chunk := stream.read(COPY_BLOCK):
            yield chunk


def _attachment(filename: str) -> str:
    """Content-Disposition for the name, as Starlette's FileResponse writes it (RFC 6266)."""
    quoted = quote(filename)
    if quoted != filename:
        return f"attachment; filename*=utf-8''{quoted}"
    return f'attachment; filename="{filename}"'


def _too_large(message: str) -> APIError:
    return APIError(413, message, param="file", code="file_too_large")


def _too_many(max_per_tenant: int) -> APIError:
    return APIError(
        400,
        f"this tenant holds {max_per_tenant} files, as many as it may: delete some first",
        param="file",
        code="too_many_files",
    )
