"""A model's engine knobs: every EngineConfig field a setting shares by name reaches the engine
(gateway.models.engine_knobs), and the models file's per-model knobs are exactly those names,
less the server's own, plus the engine client's."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import pytest

from engine.config import EngineConfig
from engine.spec_decode import SpeculativeConfig
from gateway.models.engine_knobs import CLIENT_KNOBS, ENGINE_KNOBS, SERVER_KNOBS, engine_config
from gateway.settings import Settings

SPECULATIVE = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'
# A value other than the default for every field the two share.
NOT_DEFAULTS: dict[str, Any] = {
    "model": "m",
    "dtype": "bfloat16",
    "quantization": "int8",
    "device": "cpu",
    "max_model_len": 4096,
    "block_size": 32,
    "kv_cache_memory": "1GiB",
    "memory_utilization": 0.5,
    "max_num_seqs": 8,
    "max_num_batched_tokens": 4096,
    "enable_prefix_caching": False,
    "enable_chunked_prefill": False,
    "scheduling_policy": "fcfs",
    "fair_delay_ratio": 2.0,
    "priority_max_wait": 7.5,
    "priority_step_yield": False,
    "seed": 7,
    "speculative_config": SPECULATIVE,
    "enable_lora": False,
    "max_loras": 2,
    "max_lora_rank": 8,
    "max_cpu_loras": 3,
    "lora_memory": "64MiB",
    "num_threads": 3,
    "prefill_threads": 5,
    "weights_cache_dir": "none",
    "cpu_kernels": False,
    "kernels": "torch",
    "guided_compile_timeout": 3.0,
    "guided_cache_size": 9,
    "guided_max_schema_bytes": 1000,
    "guided_max_schema_depth": 7,
}
CONVERTED = {
    "kv_cache_memory": 1 << 30,
    "lora_memory": 64 << 20,
    "speculative_config": SpeculativeConfig.parse(SPECULATIVE),
}


def test_every_shared_field_reaches_the_engine_by_its_name() -> None:
    shared = {f.name for f in fields(EngineConfig)} & set(Settings.model_fields)
    assert shared == set(NOT_DEFAULTS), "a new shared field: give it a value here"
    config = engine_config(Settings(**NOT_DEFAULTS))
    for name, value in NOT_DEFAULTS.items():
        assert getattr(config, name) == CONVERTED.get(name, value), name


@pytest.mark.parametrize("engine_process", [True, False])
def test_threads_default_to_the_cores_only_for_an_engine_process(engine_process: bool) -> None:
    config = engine_config(Settings(model="m", engine_process=engine_process))
    assert (config.num_threads is not None) == engine_process
    assert (config.prefill_threads is not None) == engine_process


def test_the_per_model_knobs_are_the_shared_fields_less_the_servers_plus_the_clients() -> None:
    shared = {f.name for f in fields(EngineConfig)} & set(Settings.model_fields)
    assert set(ENGINE_KNOBS) == (shared - SERVER_KNOBS) | CLIENT_KNOBS
    assert list(ENGINE_KNOBS) == [name for name in Settings.model_fields if name in ENGINE_KNOBS]
