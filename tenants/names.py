"""What a tenant's or an adapter's name may be.

Names are identifiers in URLs, logs and `model` fields, never paths (adapter files are stored
by content hash), but a name that looks like a path or a query invites mistakes elsewhere:
ASCII letters, digits and `._-`, starting with a letter or digit; an adapter's name may also
hold `:` and `/`-separated segments of the same kind (`org/adapter:v2`), so no segment is `.`
or `..`. The patterns are also the OpenAPI schema's (JSON Schema regular expressions).
"""

from __future__ import annotations

import re

MAX_TENANT_NAME = 64
MAX_ADAPTER_NAME = 128
TENANT_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
ADAPTER_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]*(/[A-Za-z0-9][A-Za-z0-9._:-]*)*$"


def check_tenant_name(name: str) -> str:
    return _check(name, TENANT_NAME_PATTERN, MAX_TENANT_NAME, "letters, digits and ._-")


def check_adapter_name(name: str) -> str:
    return _check(
        name, ADAPTER_NAME_PATTERN, MAX_ADAPTER_NAME, "letters, digits, ._:- and /-segments"
    )


def _check(name: str, pattern: str, max_len: int, allowed: str) -> str:
    if not 1 <= len(name) <= max_len:
        raise ValueError(f"a name has 1 to {max_len} characters")
    if not re.fullmatch(pattern.strip("^$"), name, flags=re.ASCII):
        raise ValueError(f"a name holds ASCII {allowed}, each part starting with a letter or digit")
    return name
