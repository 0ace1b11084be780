"""What the JSON schema normalizer and its negation share: the schema type, the refusal."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

Schema = dict[str, Any] | bool
ALL_TYPES = ["object", "array", "string", "number", "integer", "boolean", "null"]


class UnsupportedSchema(ValueError):
    """A schema decoding cannot enforce: the message names the JSON pointer and keyword."""

    def __init__(self, pointer: str, keyword: str, reason: str) -> None:
        self.pointer = f"{pointer}/{escape_pointer(keyword)}" if keyword else pointer or "/"
        self.keyword = keyword
        super().__init__(f"unsupported JSON schema at {self.pointer}: {reason}")


def escape_pointer(token: str) -> str:
    return token.replace("~", "~0").replace("/", "~1")


def type_set(value: Any) -> set[str]:
    if value is None:
        return set()
    return {value} if isinstance(value, str) else set(value)


def union(branches: Iterable[Schema]) -> Schema:
    """anyOf of the branches, simplified: true if one is, false if none is left."""
    kept: list[Schema] = []
    for branch in branches:
        if branch is True:
            return True
        if branch is not False and branch not in kept:
            kept.append(branch)
    if not kept:
        return False
    return kept[0] if len(kept) == 1 else {"anyOf": kept}
