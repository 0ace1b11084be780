"""Demo adapters: real PEFT adapters, reproducible, and different enough to change the output."""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from typer.testing import CliRunner

from adapters.demo import UPDATE_STRENGTH, LoraScaling, build_demo_adapter, clone_adapter
from adapters.peft import CONFIG_FILE, WEIGHTS_FILE, describe_base, load_peft_adapter
from gateway.cli import app

DemoAdapter = Callable[..., Path]  # the demo_adapter fixture (tests/conftest.py)

PROMPTS = [
    "The capital of France is",
    "def add(a, b):",
    "Once upon a time",
    "The price of the",
    "Hello, my name is",
    "Water is",
    '{"name": "',
    "Why is the sky",
]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def hf_base(demo_model_dir: Path) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(demo_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompt_ids(demo_model_dir: Path) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir)
    return [tokenizer.encode(prompt) for prompt in PROMPTS]


def files(adapter: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(adapter.iterdir())}


def greedy(model: PreTrainedModel, prompts: list[list[int]]) -> tuple[list[list[int]], list[float]]:
    """Greedy continuations and, at every generated position, the top-1 minus top-2 logit."""
    outputs, gaps = [], []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
            output_scores=True,
            return_dict_in_generate=True,
        )
        outputs.append(out.sequences[0, len(prompt) :].tolist())
        for scores in out.scores:
            top2 = scores[0].topk(2).values
            gaps.append(float(top2[0] - top2[1]))
    return outputs, gaps


def test_build_writes_a_peft_adapter(demo_adapter: DemoAdapter, demo_model_dir: Path) -> None:
    path = demo_adapter(8, "attention")
    assert set(files(path)) == {CONFIG_FILE, WEIGHTS_FILE}
    config = json.loads((path / CONFIG_FILE).read_text())
    assert config["peft_type"] == "LORA"
    assert (config["r"], config["lora_alpha"], config["use_rslora"]) == (8, 16, False)
    assert config["target_modules"] == ["k_proj", "o_proj", "q_proj", "v_proj"]  # sorted
    assert config["base_model_name_or_path"] == demo_model_dir.resolve().name
    assert (config["bias"], config["use_dora"]) == ("none", False)


def test_build_is_reproducible(
    demo_adapter: DemoAdapter, demo_model_dir: Path, tmp_path: Path
) -> None:
    again = build_demo_adapter(demo_model_dir, tmp_path / "again", rank=8, targets="all", seed=1)
    assert files(again) == files(demo_adapter(8))
    other = build_demo_adapter(demo_model_dir, tmp_path / "other", rank=8, targets="all", seed=2)
    assert files(other)[CONFIG_FILE] == files(again)[CONFIG_FILE]
    assert files(other)[WEIGHTS_FILE] != files(again)[WEIGHTS_FILE]


def test_explicit_targets_and_alpha(demo_model_dir: Path, tmp_path: Path) -> None:
    path = build_demo_adapter(
        demo_model_dir,
        tmp_path / "qv",
        rank=4,
        targets=["v_proj", "q_proj"],
        seed=7,
        scaling=LoraScaling(alpha=6),
    )
    assert json.loads((path / CONFIG_FILE).read_text())["target_modules"] == ["q_proj", "v_proj"]
    loaded = load_peft_adapter(path, describe_base(demo_model_dir), max_lora_rank=8)
    assert loaded.scaling == 6 / 4
    assert all(list(layer) == ["q_proj", "v_proj"] for layer in loaded.layers)


@pytest.mark.parametrize("targets", ["mlp", ["q_proj", "lm_head"], []])
def test_unknown_targets_are_refused(
    demo_model_dir: Path, tmp_path: Path, targets: str | list[str]
) -> None:
    with pytest.raises(ValueError, match="targets must be"):
        build_demo_adapter(demo_model_dir, tmp_path / "x", rank=4, targets=targets, seed=0)


@pytest.mark.parametrize(("rank", "rslora"), [(4, False), (16, True)])
def test_factor_scales(
    demo_adapter: DemoAdapter, demo_model_dir: Path, rank: int, rslora: bool
) -> None:
    """A x has unit-scale entries and scaling * B (A x) has UPDATE_STRENGTH's, whatever r."""
    loaded = load_peft_adapter(
        demo_adapter(rank, rslora=rslora), describe_base(demo_model_dir), max_lora_rank=16
    )
    a = torch.cat([layer["gate_proj"][0] for layer in loaded.layers])  # in_features 256
    b = torch.cat([layer["gate_proj"][1] for layer in loaded.layers])
    assert a.std().item() == pytest.approx(1 / math.sqrt(256), rel=0.05)
    assert loaded.scaling * b.std().item() == pytest.approx(
        UPDATE_STRENGTH / math.sqrt(rank), rel=0.05
    )


def test_rebuild_replaces_the_adapter_whole(demo_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "adapters" / "a"
    build_demo_adapter(demo_model_dir, out, rank=4, seed=1)
    fresh = build_demo_adapter(demo_model_dir, tmp_path / "fresh", rank=8, seed=2)
    build_demo_adapter(demo_model_dir, out, rank=8, seed=2)
    assert files(out) == files(fresh)
    assert [p.name for p in out.parent.iterdir()] == ["a"]  # no temporary directory left


def test_failed_build_keeps_the_old_adapter(demo_model_dir: Path, tmp_path: Path) -> None:
    out = build_demo_adapter(demo_model_dir, tmp_path / "adapters" / "a", rank=4, seed=1)
    before = files(out)
    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "no-such-architecture"}')
    with pytest.raises(ValueError):
        build_demo_adapter(broken, out, rank=4, seed=2)
    assert files(out) == before
    assert [p.name for p in out.parent.iterdir()] == ["a"]


def test_clone_redraws_the_factors(demo_adapter: DemoAdapter, tmp_path: Path) -> None:
    source = demo_adapter(8)
    assert files(clone_adapter(source, tmp_path / "same", seed=1)) == files(source)

    clone = clone_adapter(source, tmp_path / "other", seed=2)
    assert files(clone)[CONFIG_FILE] == files(source)[CONFIG_FILE]
    ours, theirs = load_file(clone / WEIGHTS_FILE), load_file(source / WEIGHTS_FILE)
    assert {k: v.shape for k, v in ours.items()} == {k: v.shape for k, v in theirs.items()}
    assert not any(torch.equal(ours[k], theirs[k]) for k in ours)


def test_demo_adapters_change_greedy_output(
    demo_adapter: DemoAdapter, hf_base: PreTrainedModel, prompt_ids: list[list[int]]
) -> None:
    """What the engine's LoRA tests rely on: under transformers + peft, an adapter's greedy
    output differs from the base model's and from another seed's on most prompts, and the
    top two logits stay about as far apart as the base model's."""
    base_outputs, base_gaps = greedy(hf_base, prompt_ids)
    outputs = {}
    for key, path in {
        "r8-all": demo_adapter(8),
        "r4-attention": demo_adapter(4, "attention"),
        "r8-all-seed2": demo_adapter(8, seed=2),
    }.items():
        model = PeftModel.from_pretrained(copy.deepcopy(hf_base), path).eval()
        outputs[key], gaps = greedy(model, prompt_ids)
        changed = sum(a != b for a, b in zip(outputs[key], base_outputs, strict=True))
        assert changed >= 6, f"{key}: {changed}/{len(PROMPTS)} prompts changed"
        assert sorted(gaps)[len(gaps) // 2] > 0.5 * sorted(base_gaps)[len(base_gaps) // 2]
    seeds_differ = sum(
        a != b for a, b in zip(outputs["r8-all"], outputs["r8-all-seed2"], strict=True)
    )
    assert seeds_differ >= 6


def test_cli_demo_adapter(demo_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "cli-adapter"
    args = ["demo-adapter", "--model", str(demo_model_dir), "--out", str(out), "--rank", "4"]
    result = CliRunner().invoke(app, [*args, "--targets", "q_proj,v_proj", "--seed", "5"])
    assert result.exit_code == 0, result.output
    assert result.output == f"demo adapter (rank 4, q_proj,v_proj) written to {out}\n"
    loaded = load_peft_adapter(out, describe_base(demo_model_dir), max_lora_rank=4)
    assert all(list(layer) == ["q_proj", "v_proj"] for layer in loaded.layers)

    result = CliRunner().invoke(app, [*args, "--targets", "lm_head"])
    assert result.exit_code == 1
    assert "error: targets must be" in result.output
