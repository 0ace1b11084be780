"""loragate's inference engine: paged KV cache, continuous batching, prefix caching.

Knows nothing of HTTP, tenants or the database: it takes token ids, sampling
parameters, an adapter id, a cache salt and a fairness key.
"""

from engine.config import EngineConfig
from engine.frontend.offline import LLM
from engine.llm_engine import LLMEngine
from engine.outputs import CompletionOutput, RequestOutput, SequenceUpdate
from engine.request import SamplingParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "LLMEngine",
    "RequestOutput",
    "SamplingParams",
    "SequenceUpdate",
]
