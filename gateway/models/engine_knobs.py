"""A model's engine knobs: which settings they are, and the `EngineConfig` they make.

Every `EngineConfig` field that has a `Settings` field of its name takes that field's value (a
few converted from what a flag reads: a size, the speculative config's JSON). A models file's
`engine:` overrides are those names too (gateway.models.models_file): they are applied to the
model's settings, which then go through `engine_config` like the server's own. A new engine
field with a setting of its name is thus a flag, a per-model knob and an engine value at once,
with no list to keep.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import fields
from typing import Any

from engine.config import EngineConfig
from engine.spec_decode import SpeculativeConfig
from gateway.settings import Settings, parse_bytes

# Settings an EngineConfig shares by name that stay the server's, for all its models: the model
# (a models file's `path`), and LoRA's switch and rank bound, which the adapter catalog shares.
SERVER_KNOBS = frozenset({"model", "enable_lora", "max_lora_rank"})
# The gateway's side of a model's engine, per model too: its queue's bound, whether it runs in
# a process of its own, whether that process is restarted when it dies.
CLIENT_KNOBS = frozenset({"max_waiting", "engine_process", "restart_engine"})

_CONFIG_FIELDS = frozenset(f.name for f in fields(EngineConfig)) & set(Settings.model_fields)
# In the settings' order (the flags' order in `loragate engine --help`).
ENGINE_KNOBS = tuple(
    name
    for name in Settings.model_fields
    if name in CLIENT_KNOBS or (name in _CONFIG_FIELDS and name not in SERVER_KNOBS)
)


def _size(value: str | None) -> int | None:
    return parse_bytes(value) if value else None


def _speculative(value: str | None) -> SpeculativeConfig | None:
    return None if value is None else SpeculativeConfig.parse(value)


# What a flag reads (text) that the engine takes as a value.
_CONVERTED: dict[str, Callable[[Any], Any]] = {
    "kv_cache_memory": _size,
    "lora_memory": _size,
    "speculative_config": _speculative,
}


def engine_config(settings: Settings) -> EngineConfig:
    """The engine config of these settings (a server's, or one model's: its entry's knobs
    applied), every shared field by its name."""
    values = {name: getattr(settings, name) for name in _CONFIG_FIELDS}
    for name, convert in _CONVERTED.items():
        values[name] = convert(values[name])
    # In its own process, decode steps leave one core to the HTTP side (vLLM-CPU reserves one
    # the same way); prefills, which the streams wait on, take all.
    cores = len(os.sched_getaffinity(0))
    decode, prefill = (max(1, cores - 1), cores) if settings.engine_process else (None, None)
    values["num_threads"] = settings.num_threads or decode
    values["prefill_threads"] = settings.prefill_threads or prefill
    return EngineConfig(**values)
