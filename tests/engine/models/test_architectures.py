"""Llama-family variants load from HF checkpoints and match transformers token for token:
tied embeddings with llama3 rope scaling, Qwen2 (q/k/v bias), Mistral."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch
from hf_reference import hf_greedy
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    Qwen2Config,
)

from engine import LLM, SamplingParams

SHAPE = dict(
    vocab_size=8192,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=0,
    eos_token_id=2,
    pad_token_id=0,
)
VARIANTS: dict[str, PretrainedConfig] = {
    "llama-tied-llama3-rope": LlamaConfig(
        **SHAPE,
        tie_word_embeddings=True,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 128,
        },
    ),
    "qwen2-qkv-bias": Qwen2Config(**SHAPE, tie_word_embeddings=False),
    "mistral": MistralConfig(**SHAPE, tie_word_embeddings=False, sliding_window=None),
    "llama-linear-rope": LlamaConfig(
        **SHAPE, rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}
    ),
}


def _spread_weights(model: torch.nn.Module) -> None:
    """Weights large enough that greedy argmaxes are not near-ties."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                continue
            if param.dim() == 1:  # biases
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
            elif "embed" in name:
                param.copy_(torch.randn(param.shape, generator=gen))
            else:
                std = (2.0 if "lm_head" in name else 1.0) / math.sqrt(param.shape[1])
                param.copy_(torch.randn(param.shape, generator=gen) * std)


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant_dir(
    request: pytest.FixtureRequest, demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    out = tmp_path_factory.mktemp(request.param)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(VARIANTS[request.param], dtype=torch.float32)
    _spread_weights(model)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo_model_dir / name, out / name)
    return out


def test_variant_matches_transformers(variant_dir: Path) -> None:
    prompts = [list(range(100, 100 + n)) for n in (5, 17, 40, 150)]
    refs = hf_greedy(variant_dir, prompts, 16)
    llm = LLM(
        str(variant_dir), kv_cache_memory=16 << 20, max_num_batched_tokens=32, dtype="float32"
    )
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == refs
