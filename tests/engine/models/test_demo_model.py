"""The demo checkpoint: byte-for-byte reproducible, loadable by transformers, usable."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from engine.models.demo import CHAT_TEMPLATE, DEMO_CONFIG, build_demo_model

EXPECTED_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
}


def _digests(path: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir())}


@pytest.fixture(scope="module")
def tokenizer(demo_model_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(demo_model_dir)


def test_build_is_byte_identical(demo_model_dir: Path, tmp_path: Path) -> None:
    again = build_demo_model(tmp_path / "again")
    assert set(_digests(again)) == EXPECTED_FILES
    assert _digests(again) == _digests(demo_model_dir)


def test_another_seed_gives_other_weights(demo_model_dir: Path, tmp_path: Path) -> None:
    other = _digests(build_demo_model(tmp_path / "seed1", seed=1))
    ours = _digests(demo_model_dir)
    assert other["model.safetensors"] != ours["model.safetensors"]
    assert other["tokenizer.json"] != ours["tokenizer.json"]
    assert other["config.json"] == ours["config.json"]


def test_config(demo_model_dir: Path, tokenizer: PreTrainedTokenizerBase) -> None:
    config = json.loads((demo_model_dir / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert (config["hidden_size"], config["num_hidden_layers"]) == (256, 4)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (4, 2)
    assert (config["intermediate_size"], config["vocab_size"]) == (512, 8192)
    assert config["tie_word_embeddings"] is False
    assert len(tokenizer) == DEMO_CONFIG["vocab_size"]
    assert tokenizer.bos_token == tokenizer.pad_token == "<|endoftext|>"
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", config["eos_token_id"])
    generation = json.loads((demo_model_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == tokenizer.eos_token_id


@pytest.mark.parametrize(
    "text",
    [
        "Hello, world! The model answers 42 times.",
        "  two leading spaces,\ttabs\nand newlines\n\n",
        'JSON: {"name": "loragate", "ok": true, "n": [1, 2.5, null]}',
        "café naïve résumé — “quotes” … ½ °C",
        "日本語のテキスト, 中文, 한국어, Привет, Γειά",
        "emoji 🙂🚀👍🏽 and a zero-width joiner 👩‍💻",
        "rare bytes \x00\x07\x7f \u2028 \ufeff end",
    ],
)
def test_tokenizer_round_trips(tokenizer: PreTrainedTokenizerBase, text: str) -> None:
    ids = tokenizer.encode(text)
    assert ids[0] != tokenizer.bos_token_id  # no implicit bos: the chat template decides
    assert tokenizer.decode(ids) == text


def test_special_tokens_are_single_ids(tokenizer: PreTrainedTokenizerBase) -> None:
    assert tokenizer.encode("<|im_start|>user\nhi<|im_end|>")[0] == 1
    assert tokenizer.encode("<|im_end|>") == [2]
    assert tokenizer.encode("<|endoftext|>") == [0]


def test_chat_template(tokenizer: PreTrainedTokenizerBase) -> None:
    assert tokenizer.chat_template == CHAT_TEMPLATE
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Capital of France?"},
    ]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    assert rendered == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nCapital of France?<|im_end|>\n"
    )
    prompted = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompted == rendered + "<|im_start|>assistant\n"


def test_transformers_generates_with_separated_logits(
    demo_model_dir: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    model = AutoModelForCausalLM.from_pretrained(demo_model_dir)
    assert model.dtype == torch.float32
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Tell me about the river."}],
        tokenize=False,
        add_generation_prompt=True,
    )
    input_ids = tokenizer(prompt, return_tensors="pt").input_ids
    out = model.generate(
        input_ids,
        max_new_tokens=64,
        min_new_tokens=64,
        do_sample=False,
        output_scores=True,
        return_dict_in_generate=True,
    )
    new_tokens = out.sequences[0, input_ids.shape[1] :].tolist()
    assert len(new_tokens) == 64
    assert len(set(new_tokens)) > 16  # not a single token repeated
    # Top-1 vs top-2 logit gaps: well apart, so greedy decoding is robust to
    # float rounding differences between implementations.
    top2 = torch.stack([scores[0].topk(2).values for scores in out.scores])
    gaps = top2[:, 0] - top2[:, 1]
    assert gaps.median() > 0.3
    assert (gaps > 0.05).float().mean() > 0.8
