"""References in a JSON schema: each internal `$ref` target normalized once into a generated
`$defs` entry (so recursion stays recursion), and a reference resolved to what it stands for."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import unquote

from engine.guided.schema_types import Schema, UnsupportedSchema


class References:
    """`node(schema, ptr)` normalizes a target (the normalizer's own step)."""

    def __init__(self, root: dict[str, Any], node: Callable[[Any, str], Schema]) -> None:
        self.root = root
        self.node = node
        self.names: dict[str, str] = {}  # ref target pointer -> generated $defs name
        self.defs: dict[str, Schema | None] = {}  # None while the target is being normalized

    def ref(self, ref: Any, ptr: str) -> Schema:
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            raise UnsupportedSchema(
                ptr,
                "$ref",
                f"external reference {ref!r}: only references inside the schema (#/...) "
                "are supported",
            )
        target_ptr = unquote(ref[1:])
        if target_ptr not in self.names:
            target = self.resolve(target_ptr, ptr)
            name = f"n{len(self.names)}"
            self.names[target_ptr] = name
            self.defs[name] = None
            self.defs[name] = self.node(target, target_ptr)
        name = self.names[target_ptr]
        done = self.defs[name]
        if isinstance(done, bool):
            return done
        return {"$ref": f"#/$defs/{name}"}

    def resolve(self, target_ptr: str, ptr: str) -> Any:
        try:
            return follow_pointer(self.root, target_ptr.split("/")[1:])
        except LookupError:
            raise UnsupportedSchema(ptr, "$ref", f"cannot resolve '#{target_ptr}'") from None

    def deref(self, schema: Schema) -> Schema:
        """The schema a bare generated reference stands for (one built already)."""
        seen = 0
        while isinstance(schema, dict) and set(schema) == {"$ref"}:
            target = self.defs.get(schema["$ref"].rsplit("/", 1)[-1])
            if target is None or seen > len(self.defs):
                return schema  # still being built: a recursive reference, left as it is
            schema, seen = target, seen + 1
        return schema


def follow_pointer(root: Any, tokens: Iterable[str]) -> Any:
    """The node a JSON pointer's tokens (escaped as in the pointer: ~1, ~0) lead to from
    `root`. Raises LookupError where they lead nowhere."""
    node = root
    for escaped in tokens:
        token = escaped.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and token in node:
            node = node[token]
        elif isinstance(node, list) and token.isdigit() and int(token) < len(node):
            node = node[int(token)]
        else:
            raise LookupError(escaped)
    return node
