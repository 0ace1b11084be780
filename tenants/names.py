"""What a tenant's or an adapter's name may be.

Names are identifiers in URLs, logs and `model` fields, never paths (adapter files are stored
by content hash), but a name that looks like a path or a query invites mistakes elsewhere:
ASCII letters, digits and `._-` (adapters also `/` and `:`, as in `org/adapter:v2`), starting
with a letter or digit, no `..`.
"""

from __future__ import annotations

import re

MAX_TENANT_NAME = 64
MAX_ADAPTER_NAME = 128
_TENANT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_ADAPTER = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]*")


def check_tenant_name(name: str) -> str:
    return _check(name, _TENANT, MAX_TENANT_NAME, "letters, digits and ._-")


def check_adapter_name(name: str) -> str:
    return _check(name, _ADAPTER, MAX_ADAPTER_NAME, "letters, digits and ._:/-")


def _check(name: str, pattern: re.Pattern[str], max_len: int, allowed: str) -> str:
    if not 1 <= len(name) <= max_len:
        raise ValueError(f"a name has 1 to {max_len} characters")
    if not pattern.fullmatch(name) or ".." in name or name.endswith("/"):
        raise ValueError(
            f"a name holds ASCII {allowed}, starts with a letter or digit and has no '..'"
        )
    return name
