"""Log probabilities in OpenAI's two shapes: chat's `content` entries (token, bytes, top
alternatives) and completions' parallel lists (tokens, token_logprobs, top_logprobs,
text_offset)."""

from __future__ import annotations

from typing import Any, cast


def logprobs_body(
    tokenizer: Any, token_ids: list[int], entries: list[dict[int, float]], chat: bool
) -> dict[str, Any]:
    """`entries[i]` maps the top token ids at step i (the chosen one among them) to their
    log probabilities."""
    decode = tokenizer.decode
    if chat:
        content = []
        for token_id, entry in zip(token_ids, entries, strict=False):
            token: str = decode([token_id])
            top = sorted(entry.items(), key=lambda kv: -kv[1])
            content.append(
                {
                    "token": token,
                    "logprob": entry[token_id],
                    "bytes": list(token.encode()),
                    "top_logprobs": [
                        {
                            "token": decode([t]),
                            "logprob": lp,
                            "bytes": list(cast(str, decode([t])).encode()),
                        }
                        for t, lp in top
                    ],
                }
            )
        return {"content": content}
    tokens = [decode([t]) for t in token_ids]
    offsets, pos = [], 0
    for token in tokens:
        offsets.append(pos)
        pos += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [e[t] for t, e in zip(token_ids, entries, strict=False)],
        "top_logprobs": [{decode([t]): lp for t, lp in e.items()} for e in entries],
        "text_offset": offsets,
    }
