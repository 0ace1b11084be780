"""The `compaction` item a compaction (gateway.openai.responses.compaction) ends with, and a
later request reads back: its `encrypted_content` is the summary, encoded (JSON, then URL-safe
base64, after a format prefix). Encoded, not encrypted: the summary is text the client could
have sent itself, and the server keeps nothing of it."""

from __future__ import annotations

import base64
import json
from typing import Any

PREFIX = "lgc1."  # what our compaction items' content starts with (a format version)


def compaction_item(summary: str, item_id: str) -> dict[str, Any]:
    encoded = base64.urlsafe_b64encode(json.dumps({"summary": summary}).encode()).decode()
    return {
        "type": "compaction",
        "id": item_id,
        "encrypted_content": PREFIX + encoded,
    }


def summary_of(encrypted_content: str) -> str:
    """The summary a compaction item holds. Raises ValueError for content this server did
    not make (another provider's, or altered)."""
    if not encrypted_content.startswith(PREFIX):
        raise ValueError("a compaction item made by another server")
    try:
        raw = base64.urlsafe_b64decode(encrypted_content.removeprefix(PREFIX).encode())
        summary = json.loads(raw)["summary"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError("a compaction item whose content does not decode") from exc
    if not isinstance(summary, str):
        raise ValueError("a compaction item whose content does not decode")
    return summary
