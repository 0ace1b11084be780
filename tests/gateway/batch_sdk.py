"""A batch made the way a customer makes one: its lines uploaded as a file and a batch created
through the openai SDK, then polled until it ends (for tests of what shows batches: the admin
REST, the console)."""

from __future__ import annotations

import io
import json
import time
from typing import Any

import openai
from openai.types import Batch

from tenants.batches import ENDED


def chat_line(custom_id: str, text: str, max_tokens: int, **fields: Any) -> dict[str, Any]:
    """A greedy chat line for the model `demo`."""
    body = {"model": "demo", "messages": [{"role": "user", "content": text}]}
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": body | {"max_tokens": max_tokens, "temperature": 0} | fields,
    }


def start_batch(
    client: openai.OpenAI, lines: list[dict[str, Any]], filename: str = "batch.jsonl"
) -> Batch:
    """The lines (all to the first one's url) uploaded as `filename` and made a batch."""
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    file = client.files.create(file=(filename, io.BytesIO(data)), purpose="batch")
    return client.batches.create(
        input_file_id=file.id,
        endpoint=lines[0]["url"],
        completion_window="24h",
        metadata={"file": filename},
    )


def wait_ended(client: openai.OpenAI, batch_id: str, timeout: float = 120.0) -> Batch:
    """The batch once it ended (completed, failed, expired, cancelled); fails at the deadline."""
    deadline = time.monotonic() + timeout
    while (batch := client.batches.retrieve(batch_id)).status not in ENDED:
        assert time.monotonic() < deadline, f"batch {batch_id} still {batch.status}"
        time.sleep(0.1)
    return batch
