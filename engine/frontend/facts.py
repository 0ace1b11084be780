"""`EngineFacts`: what the gateway knows of a model's engine, whichever engine it is (a loop in
this process, an engine process, one started on demand, engines elsewhere): the tokenizer (chat
templates, token counts at the edge), the vocabulary that token ids are checked against, the
context length and the end-of-sequence tokens. Every engine client exposes one as `.facts`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class EngineFacts:
    # None only inside the engine process's Ready message: a tokenizer is dear to pickle, and
    # the gateway's side loads its own (engine.frontend.engine_process).
    tokenizer: Any
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def read(cls, model: str, max_model_len: int | None) -> EngineFacts:
        """A model directory's facts, as its engine will have them (engine.llm_engine reads the
        same files), for a gateway that tokenizes and checks requests before any engine of the
        model runs (one started on demand, engines elsewhere)."""
        from transformers import AutoConfig, AutoTokenizer

        from engine.models.llama import eos_token_ids

        config = AutoConfig.from_pretrained(model)
        tokenizer = AutoTokenizer.from_pretrained(model)
        return cls(
            tokenizer,
            int(config.vocab_size),
            max_model_len or int(config.max_position_embeddings),
            tuple(sorted(eos_token_ids(config, tokenizer, model))),
        )
