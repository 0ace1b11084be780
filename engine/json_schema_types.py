"""What the JSON schema normalizer and its negation share: the schema type, the refusal."""

from __future__ import annotations

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
