"""PEFT adapter directories -> LoRAWeights: what peft loads, loaded the same; the rest refused."""

from __future__ import annotations

import copy
import hashlib
import json
import math
import random
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import PeftModel
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, PreTrainedModel

from adapters.demo import TARGET_PRESETS, build_demo_adapter, clone_adapter
from adapters.peft import (
    CONFIG_FILE,
    PICKLE_FILE,
    WEIGHTS_FILE,
    AdapterError,
    BaseModelInfo,
    adapter_identity,
    describe_base,
    load_peft_adapter,
)
from engine.lora.types import LORA_TARGETS, LoRAWeights

DemoAdapter = Callable[..., Path]  # the demo_adapter fixture (tests/conftest.py)
BLOCK = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn"}
BLOCK |= {"o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
# Names as peft 0.21 saves them.
Q0 = "base_model.model.model.layers.0.self_attn.q_proj"
K0 = "base_model.model.model.layers.0.self_attn.k_proj"
MAX_RANK = 16


@pytest.fixture(scope="module")
def demo_base(demo_model_dir: Path) -> BaseModelInfo:
    return describe_base(demo_model_dir)


@pytest.fixture(scope="module")
def hf_base(demo_model_dir: Path) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(demo_model_dir, dtype=torch.float32).eval()


def copy_adapter(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_config(adapter: Path, **changes: Any) -> None:
    path = adapter / CONFIG_FILE
    config = json.loads(path.read_text())
    path.write_text(json.dumps(config | changes, indent=2))


def edit_tensors(adapter: Path, edit: Callable[[dict[str, torch.Tensor]], object]) -> None:
    tensors = load_file(adapter / WEIGHTS_FILE)
    edit(tensors)
    save_file(tensors, adapter / WEIGHTS_FILE, metadata={"format": "pt"})


# --- the base model ---------------------------------------------------------------------


def test_describe_base_demo(demo_model_dir: Path) -> None:
    base = describe_base(demo_model_dir, extra_names=["served-demo"])
    assert base.names == (demo_model_dir.resolve().name, "served-demo")
    assert base.num_layers == 4
    # hidden 256, 4 heads and 2 KV heads of 64, intermediate 512.
    assert base.module_shapes == {
        "q_proj": (256, 256),
        "k_proj": (256, 128),
        "v_proj": (256, 128),
        "o_proj": (256, 256),
        "gate_proj": (256, 512),
        "up_proj": (256, 512),
        "down_proj": (512, 256),
    }


def test_describe_base_derives_head_dim_and_reads_name_or_path(tmp_path: Path) -> None:
    config = {
        "hidden_size": 64,
        "num_attention_heads": 8,
        "num_hidden_layers": 2,
        "intermediate_size": 96,
        "_name_or_path": "org/Tiny-Llama",
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    base = describe_base(tmp_path)
    assert base.names == (tmp_path.name, "org/Tiny-Llama")
    # No head_dim and no num_key_value_heads: 64 / 8 = 8 per head, as many KV heads as heads.
    assert base.module_shapes["k_proj"] == (64, 64)
    assert base.module_shapes["down_proj"] == (96, 64)


# --- loading ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rank", "targets", "rslora"), [(4, "attention", False), (8, "all", False), (16, "all", True)]
)
def test_loads_what_peft_loads(
    demo_adapter: DemoAdapter,
    demo_base: BaseModelInfo,
    hf_base: PreTrainedModel,
    rank: int,
    targets: str,
    rslora: bool,
) -> None:
    path = demo_adapter(rank, targets, rslora=rslora)
    loaded = load_peft_adapter(path, demo_base, MAX_RANK)
    peft_model = PeftModel.from_pretrained(copy.deepcopy(hf_base), path)

    alpha = 2 * rank  # the demo builder's default
    assert loaded.rank == rank
    assert loaded.scaling == (alpha / math.sqrt(rank) if rslora else alpha / rank)
    assert loaded.adapter_id == adapter_identity(path)
    assert len(loaded.layers) == demo_base.num_layers
    for i, layer in enumerate(loaded.layers):
        assert list(layer) == list(TARGET_PRESETS[targets])
        for module, (a, b) in layer.items():
            lora = peft_model.get_submodule(
                f"base_model.model.model.layers.{i}.{BLOCK[module]}.{module}"
            )
            assert torch.equal(a, lora.lora_A["default"].weight)
            assert torch.equal(b, lora.lora_B["default"].weight)
            assert lora.scaling["default"] == loaded.scaling
            for factor in (a, b):
                assert factor.dtype == torch.float32
                assert factor.device.type == "cpu"
                assert factor.is_contiguous()


def test_loaded_factors_are_copies(demo_adapter: DemoAdapter, demo_base: BaseModelInfo) -> None:
    path = demo_adapter(8)
    first = load_peft_adapter(path, demo_base, MAX_RANK)
    first.layers[0]["q_proj"][0].zero_()  # the engine may own and modify what it is handed
    second = load_peft_adapter(path, demo_base, MAX_RANK)
    assert second.layers[0]["q_proj"][0].abs().sum() > 0


def test_half_precision_factors_come_back_float32(
    demo_adapter: DemoAdapter, demo_base: BaseModelInfo, tmp_path: Path
) -> None:
    path = copy_adapter(demo_adapter(4, "attention"), tmp_path / "bf16")
    edit_tensors(path, lambda t: t.update({k: v.to(torch.bfloat16) for k, v in t.items()}))
    loaded = load_peft_adapter(path, demo_base, MAX_RANK)
    a, b = loaded.layers[2]["v_proj"]
    stored = load_file(path / WEIGHTS_FILE)[
        "base_model.model.model.layers.2.self_attn.v_proj.lora_A.weight"
    ]
    assert a.dtype == b.dtype == torch.float32
    assert torch.equal(a, stored.float())


def test_adapter_name_segment_is_tolerated(
    demo_adapter: DemoAdapter, demo_base: BaseModelInfo, tmp_path: Path
) -> None:
    """Older peft and some trainers save `lora_A.default.weight`: the same adapter."""
    original = demo_adapter(8)
    path = copy_adapter(original, tmp_path / "named")

    def insert_name(tensors: dict[str, torch.Tensor]) -> None:
        for key in list(tensors):
            tensors[key.replace(".weight", ".default.weight")] = tensors.pop(key)

    edit_tensors(path, insert_name)
    renamed = load_peft_adapter(path, demo_base, MAX_RANK)
    expected = load_peft_adapter(original, demo_base, MAX_RANK)
    for got, want in zip(renamed.layers, expected.layers, strict=True):
        assert list(got) == list(want)
        assert all(torch.equal(got[m][0], want[m][0]) for m in want)
        assert all(torch.equal(got[m][1], want[m][1]) for m in want)


@pytest.mark.parametrize(
    "target_modules",
    [
        "all-linear",
        r".*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)",
        ["self_attn.q_proj", "k_proj", "v_proj", "o_proj", "mlp.gate_proj", "up_proj", "down_proj"],
    ],
    ids=["all-linear", "pattern", "dotted-suffixes"],
)
def test_target_modules_forms(
    demo_adapter: DemoAdapter, demo_base: BaseModelInfo, tmp_path: Path, target_modules: Any
) -> None:
    path = copy_adapter(demo_adapter(8), tmp_path / "targets")
    edit_config(path, target_modules=target_modules)
    loaded = load_peft_adapter(path, demo_base, MAX_RANK)
    assert all(list(layer) == list(LORA_TARGETS) for layer in loaded.layers)


def test_adapter_of_some_layers_and_modules(
    demo_adapter: DemoAdapter, demo_base: BaseModelInfo, tmp_path: Path
) -> None:
    """Modules without tensors are not adapted, as peft leaves them (lora_B starts at zero)."""
    path = copy_adapter(demo_adapter(8), tmp_path / "partial")
    edit_tensors(path, lambda t: [t.pop(k) for k in list(t) if "layers.1." in k or "up_proj" in k])
    loaded = load_peft_adapter(path, demo_base, MAX_RANK)
    assert loaded.layers[1] == {}
    assert list(loaded.layers[0]) == [
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "down_proj",
    ]


# --- identity ------------------------------------------------------------------------------


def test_identity_is_length_prefixed_sha256(demo_adapter: DemoAdapter) -> None:
    path = demo_adapter(4, "attention")
    digest = hashlib.sha256()
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        data = (path / name).read_bytes()
        digest.update(len(data).to_bytes(8, "big") + data)
    assert adapter_identity(path) == digest.hexdigest()


def test_identity_is_stable_and_follows_content(
    demo_model_dir: Path, demo_adapter: DemoAdapter, tmp_path: Path
) -> None:
    path = demo_adapter(8)
    rebuilt = build_demo_adapter(demo_model_dir, tmp_path / "rebuilt", rank=8, seed=1)
    assert adapter_identity(rebuilt) == adapter_identity(path)  # same seed, same adapter

    reseeded = clone_adapter(path, tmp_path / "reseeded", seed=2)
    assert adapter_identity(reseeded) != adapter_identity(path)

    one_value = copy_adapter(path, tmp_path / "one-value")
    edit_tensors(one_value, lambda t: t[f"{Q0}.lora_B.weight"][0].__setitem__(0, 0.0))
    assert adapter_identity(one_value) != adapter_identity(path)

    reformatted = copy_adapter(path, tmp_path / "reformatted")
    config = (reformatted / CONFIG_FILE).read_text()
    (reformatted / CONFIG_FILE).write_text(config + "\n")
    assert adapter_identity(reformatted) != adapter_identity(path)


def test_identity_does_not_alias_across_files(tmp_path: Path) -> None:
    """The same bytes split differently between the two files are different adapters."""
    left, right = tmp_path / "left", tmp_path / "right"
    for directory, config, weights in ((left, b'{"r": 8}', b"abc"), (right, b'{"r": 8}a', b"bc")):
        directory.mkdir()
        (directory / CONFIG_FILE).write_bytes(config)
        (directory / WEIGHTS_FILE).write_bytes(weights)
    assert adapter_identity(left) != adapter_identity(right)


# --- refusals ------------------------------------------------------------------------------


def _pickle_instead(adapter: Path) -> None:
    torch.save(load_file(adapter / WEIGHTS_FILE), adapter / PICKLE_FILE)
    (adapter / WEIGHTS_FILE).unlink()


def _truncate(adapter: Path) -> None:
    data = (adapter / WEIGHTS_FILE).read_bytes()
    (adapter / WEIGHTS_FILE).write_bytes(data[: len(data) // 2])


def _config(**changes: Any) -> Callable[[Path], None]:
    return lambda adapter: edit_config(adapter, **changes)


def _tensors(edit: Callable[[dict[str, torch.Tensor]], object]) -> Callable[[Path], None]:
    return lambda adapter: edit_tensors(adapter, edit)


def _rename_layer(tensors: dict[str, torch.Tensor], old: str, new: str) -> None:
    for key in [k for k in tensors if old in k]:
        tensors[key.replace(old, new)] = tensors.pop(key)


REFUSALS = [
    pytest.param(shutil.rmtree, r"no adapter directory at '.*'", id="missing-directory"),
    pytest.param(
        lambda d: (d / CONFIG_FILE).unlink(),
        r"adapter_config\.json is missing from the adapter directory",
        id="missing-config",
    ),
    pytest.param(
        lambda d: (d / WEIGHTS_FILE).unlink(),
        r"adapter_model\.safetensors is missing from the adapter directory",
        id="missing-weights",
    ),
    pytest.param(
        _pickle_instead,
        r"adapter_model\.bin is refused: it is a Python pickle, and unpickling can run arbitrary "
        r"code\. Convert it to adapter_model\.safetensors",
        id="pickle",
    ),
    pytest.param(
        _truncate, r"adapter_model\.safetensors is not a valid safetensors file", id="truncated"
    ),
    pytest.param(
        lambda d: (d / WEIGHTS_FILE).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}  "),
        r"adapter_model\.safetensors is not a valid safetensors file",
        id="corrupt-safetensors",
    ),
    pytest.param(
        lambda d: (d / CONFIG_FILE).write_text('{"peft_type": "LORA", "r": 8,'),
        r"adapter_config\.json is not valid JSON",
        id="corrupt-json",
    ),
    pytest.param(
        lambda d: (d / CONFIG_FILE).write_text("[8, 16]"),
        r"adapter_config\.json must hold a JSON object, not list",
        id="config-not-an-object",
    ),
    pytest.param(
        _config(peft_type="IA3"),
        r"adapter_config\.json: peft_type is 'IA3'; only LORA adapters are supported",
        id="not-lora",
    ),
    pytest.param(
        _config(use_dora=True),
        r"use_dora=True is not supported: DoRA rescales every adapted weight",
        id="dora",
    ),
    pytest.param(
        _config(modules_to_save=["lm_head"]),
        r"modules_to_save=\['lm_head'\] is not supported: it replaces whole base-model modules",
        id="modules-to-save",
    ),
    pytest.param(
        _config(bias="lora_only"),
        r"bias='lora_only' is not supported: the adapter trained base-model biases",
        id="bias",
    ),
    pytest.param(
        _config(layers_to_transform=[0, 1]),
        r"layers_to_transform=\[0, 1\] is not supported",
        id="layers-to-transform",
    ),
    pytest.param(
        _config(layers_to_transform=0),
        r"layers_to_transform=0 is not supported",
        id="layers-to-transform-zero",
    ),
    pytest.param(
        _config(layers_pattern="layers"),
        r"layers_pattern='layers' is not supported",
        id="layers-pattern",
    ),
    pytest.param(
        _config(rank_pattern={"q_proj": 4}),
        r"rank_pattern=\{'q_proj': 4\} is not supported: the engine holds one rank per adapter",
        id="rank-pattern",
    ),
    pytest.param(
        _config(alpha_pattern={"q_proj": 32}),
        r"alpha_pattern=\{'q_proj': 32\} is not supported: the engine holds one scaling",
        id="alpha-pattern",
    ),
    pytest.param(_config(lora_bias=True), r"lora_bias=True is not supported", id="lora-bias"),
    pytest.param(
        _config(init_lora_weights="pissa_niter_4"),
        r"init_lora_weights='pissa_niter_4' is not supported: the adapter is only valid on the "
        r"base weights its initialisation modified",
        id="pissa",
    ),
    pytest.param(
        _config(target_modules=["q_proj", "lm_head"]),
        r"adapter_config\.json: target module 'lm_head' is not supported; supported: q_proj, "
        r"k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj",
        id="unknown-target",
    ),
    pytest.param(
        _config(target_modules="(q|k_proj"),
        r"target_modules '\(q\|k_proj' is not a valid pattern",
        id="bad-pattern",
    ),
    pytest.param(
        _config(target_modules=["q_proj", "v_proj"]),
        r"adapter_model\.safetensors: tensor '.*' adapts \w+_proj, which target_modules "
        r"\['q_proj', 'v_proj'\] does not include",
        id="tensor-outside-targets",
    ),
    pytest.param(
        _config(r="8"), r"adapter_config\.json: r must be a positive integer, got '8'", id="r-str"
    ),
    pytest.param(_config(r=0), r"r must be a positive integer, got 0", id="r-zero"),
    pytest.param(
        _config(lora_alpha=float("nan")),
        r"lora_alpha must be a finite number, got nan",
        id="alpha-nan",
    ),
    pytest.param(
        _config(use_rslora="yes"), r"use_rslora must be true or false, got 'yes'", id="rslora-str"
    ),
    pytest.param(
        _config(r=32),
        r"adapter_config\.json: rank r=32 exceeds this server's max_lora_rank 16",
        id="rank-too-high",
    ),
    pytest.param(
        _config(base_model_name_or_path="meta-llama/Llama-3.1-8B"),
        r"adapter was trained for 'meta-llama/Llama-3\.1-8B', not for base model '.+'",
        id="wrong-base",
    ),
    pytest.param(
        _config(r=4),
        rf"adapter_model\.safetensors: layer 0 q_proj lora_A \('{Q0}\.lora_A\.weight'\) has shape "
        r"\[8, 256\]; expected \[4, 256\] = \[r, in_features\]",
        id="rank-differs-from-r",
    ),
    pytest.param(
        _tensors(lambda t: t.pop(f"{Q0}.lora_B.weight")),
        r"adapter_model\.safetensors: layer 0 q_proj has lora_A but no lora_B; both factors "
        r"are needed",
        id="half-pair-no-B",
    ),
    pytest.param(
        _tensors(lambda t: t.pop(f"{K0}.lora_A.weight")),
        r"layer 0 k_proj has lora_B but no lora_A",
        id="half-pair-no-A",
    ),
    pytest.param(
        _tensors(lambda t: t.update({f"{Q0}.lora_A.weight": torch.zeros(8, 128)})),
        r"layer 0 q_proj lora_A \(.*\) has shape \[8, 128\]; expected \[8, 256\] = "
        r"\[r, in_features\]",
        id="A-shape",
    ),
    pytest.param(
        _tensors(lambda t: t.update({f"{K0}.lora_B.weight": torch.zeros(256, 8)})),
        r"layer 0 k_proj lora_B \(.*\) has shape \[256, 8\]; expected \[128, 8\] = "
        r"\[out_features, r\]",
        id="B-shape",
    ),
    pytest.param(
        _tensors(lambda t: _rename_layer(t, "layers.3.", "layers.4.")),
        r"tensor '.*layers\.4\..*' is for layer 4, but the base model has 4 layers \(0\.\.3\)",
        id="layer-out-of-range",
    ),
    pytest.param(
        _tensors(
            lambda t: t.update({"base_model.model.lm_head.lora_A.weight": torch.zeros(8, 256)})
        ),
        r"tensor 'base_model\.model\.lm_head\.lora_A\.weight' is not a lora_A/lora_B weight of "
        r"q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj in a decoder layer",
        id="unknown-tensor",
    ),
    pytest.param(
        _tensors(lambda t: t.update({f"{Q0}.lora_magnitude_vector": torch.ones(256)})),
        r"tensor '.*q_proj\.lora_magnitude_vector' is not a lora_A/lora_B weight",
        id="dora-tensor",
    ),
    pytest.param(
        _tensors(lambda t: _rename_layer(t, "layers.0.self_attn.q_proj", "layers.0.mlp.q_proj")),
        r"tensor '.*layers\.0\.mlp\.q_proj\.lora_[AB]\.weight' is not a lora_A/lora_B weight",
        id="module-in-wrong-block",
    ),
    pytest.param(
        _tensors(
            lambda t: t.update({f"{Q0}.lora_A.default.weight": t[f"{Q0}.lora_A.weight"].clone()})
        ),
        r"layer 0 q_proj has two lora_A tensors",
        id="duplicate",
    ),
    pytest.param(_tensors(lambda t: t.clear()), r"holds no LoRA tensors", id="no-tensors"),
    pytest.param(
        _tensors(lambda t: t[f"{Q0}.lora_B.weight"].view(-1)[5].fill_(float("nan"))),
        r"layer 0 q_proj lora_B \(.*\) holds NaN or infinite values",
        id="nan",
    ),
    pytest.param(
        _tensors(
            lambda t: t.update({f"{Q0}.lora_A.weight": torch.zeros(8, 256, dtype=torch.int32)})
        ),
        r"layer 0 q_proj lora_A \(.*\) has dtype torch\.int32; expected float16, bfloat16, "
        r"float32 or float64",
        id="int-dtype",
    ),
]


@pytest.mark.parametrize(("malform", "message"), REFUSALS)
def test_refused(
    demo_adapter: DemoAdapter,
    demo_base: BaseModelInfo,
    tmp_path: Path,
    malform: Callable[[Path], None],
    message: str,
) -> None:
    path = copy_adapter(demo_adapter(8), tmp_path / "adapter")
    malform(path)
    with pytest.raises(AdapterError, match=message):
        load_peft_adapter(path, demo_base, MAX_RANK)


def test_base_model_matches_by_last_path_component_any_case(
    demo_adapter: DemoAdapter, demo_model_dir: Path, tmp_path: Path
) -> None:
    path = copy_adapter(demo_adapter(4, "attention"), tmp_path / "adapter")
    base = describe_base(demo_model_dir, extra_names=["SmolLM2-135M-Instruct"])
    edit_config(path, base_model_name_or_path="HuggingFaceTB/smollm2-135m-instruct/")
    load_peft_adapter(path, base, MAX_RANK)
    edit_config(path, base_model_name_or_path=None)  # unknown base: nothing to compare
    load_peft_adapter(path, base, MAX_RANK)


def test_expected_id(demo_adapter: DemoAdapter, demo_base: BaseModelInfo, tmp_path: Path) -> None:
    path = copy_adapter(demo_adapter(8), tmp_path / "adapter")
    registered = adapter_identity(path)
    assert load_peft_adapter(path, demo_base, MAX_RANK, expected_id=registered)

    edit_tensors(path, lambda t: t[f"{Q0}.lora_A.weight"].mul_(2))
    with pytest.raises(
        AdapterError,
        match=rf"adapter files changed since registration: sha256 is [0-9a-f]{{64}}, "
        rf"registered as {registered}",
    ):
        load_peft_adapter(path, demo_base, MAX_RANK, expected_id=registered)


def test_oversized_weights_are_refused_unread(
    demo_adapter: DemoAdapter, demo_base: BaseModelInfo, tmp_path: Path
) -> None:
    path = copy_adapter(demo_adapter(8), tmp_path / "adapter")
    with (path / WEIGHTS_FILE).open("r+b") as f:
        f.truncate(1 << 40)  # sparse: a terabyte that takes no disk
    with pytest.raises(
        AdapterError,
        match=r"adapter_model\.safetensors is over \d+ bytes: no rank-8 adapter of this base "
        r"model is that large",
    ):
        load_peft_adapter(path, demo_base, MAX_RANK)


# --- fuzzing ---------------------------------------------------------------------------------

ODD_VALUES: list[Any] = [
    None, True, False, 0, -1, 3, 8, 10**30, 1e308, -0.5, "", "x", "LORA", "all-linear", "none",
    "q_proj", [], {}, [0], ["q_proj"], ["lm_head"], {"q_proj": 2}, [[1]], {"a": {"b": []}},
]  # fmt: skip


def _mutate_config(rng: random.Random, config: bytes) -> bytes:
    if rng.random() < 0.3:  # raw bytes: broken JSON, broken UTF-8
        data = bytearray(config)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        return bytes(data)
    obj = json.loads(config)
    for _ in range(rng.randint(1, 3)):
        key = rng.choice([*obj, "use_dora", "rank_pattern", "layers_to_transform"])
        obj[key] = rng.choice(ODD_VALUES)
    return json.dumps(obj).encode()


def _mutate_weights(rng: random.Random, weights: bytes) -> bytes:
    choice = rng.randrange(4)
    if choice == 0:  # flipped bytes anywhere: the header or the data
        data = bytearray(weights)
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        return bytes(data)
    if choice == 1:
        return weights[: rng.randrange(len(weights))]
    # A well-formed header that says something else: dtype, shape, offsets or name.
    (header_len,) = struct.unpack("<Q", weights[:8])
    header = json.loads(weights[8 : 8 + header_len])
    key = rng.choice([k for k in header if k != "__metadata__"])
    entry = header[key]
    if choice == 2:
        field = rng.choice(["dtype", "shape", "data_offsets"])
        entry[field] = rng.choice(
            {
                "dtype": ["F16", "BF16", "F64", "I32", "BOOL", "U8", "F8_E4M3", "X"],
                "shape": [[], [8], [4, 256], [256, 4], [2, 2, 256], [0, 256], [-1, 4]],
                "data_offsets": [[0, 0], [0, 16], [1, 2], [10**9, 10**9 + 4], [-4, 0]],
            }[field]
        )
    else:
        new_key = rng.choice(
            [key.replace("layers.", "layers.1"), key.replace("lora_A", "lora_C"), "x", key + "."]
        )
        header[new_key] = header.pop(key)
    body = json.dumps(header).encode()
    return struct.pack("<Q", len(body)) + body + weights[8 + header_len :]


def _assert_well_formed(loaded: LoRAWeights, base: BaseModelInfo) -> None:
    assert len(loaded.layers) == base.num_layers
    for layer in loaded.layers:
        for module, (a, b) in layer.items():
            in_features, out_features = base.module_shapes[module]
            assert a.shape == (loaded.rank, in_features)
            assert b.shape == (out_features, loaded.rank)
            assert a.dtype == b.dtype == torch.float32
            assert bool(torch.isfinite(a).all() and torch.isfinite(b).all())


def test_fuzzed_adapters_raise_only_adapter_error(
    demo_adapter: DemoAdapter, demo_base: BaseModelInfo, tmp_path: Path
) -> None:
    source = demo_adapter(4, "attention")
    config, weights = (source / CONFIG_FILE).read_bytes(), (source / WEIGHTS_FILE).read_bytes()
    rng = random.Random(0)
    outcomes = {"loaded": 0, "refused": 0}
    for case in range(400):
        path = tmp_path / str(case)
        path.mkdir()
        mutated = rng.random() < 0.5
        (path / CONFIG_FILE).write_bytes(_mutate_config(rng, config) if mutated else config)
        (path / WEIGHTS_FILE).write_bytes(weights if mutated else _mutate_weights(rng, weights))
        try:
            loaded = load_peft_adapter(path, demo_base, MAX_RANK)
        except AdapterError:
            outcomes["refused"] += 1
        else:
            outcomes["loaded"] += 1
            _assert_well_formed(loaded, demo_base)
    assert outcomes["refused"] > 100 and outcomes["loaded"] > 10, outcomes


# --- a real model ----------------------------------------------------------------------------


@pytest.mark.smollm2
def test_smollm2_rank16_all_linear_adapter_loads(smollm2_dir: Path, tmp_path: Path) -> None:
    path = build_demo_adapter(smollm2_dir, tmp_path / "smollm2-r16", rank=16, seed=3)
    base = describe_base(smollm2_dir)
    loaded = load_peft_adapter(path, base, max_lora_rank=16)

    # 30 layers; hidden 576, 9 heads and 3 KV heads of 64, intermediate 1536.
    assert len(loaded.layers) == 30
    assert all(list(layer) == list(LORA_TARGETS) for layer in loaded.layers)
    a, b = loaded.layers[29]["k_proj"]
    assert (a.shape, b.shape) == ((16, 576), (192, 16))
    a, b = loaded.layers[0]["down_proj"]
    assert (a.shape, b.shape) == ((16, 1536), (576, 16))
    with safe_open(str(path / WEIGHTS_FILE), framework="pt") as f:
        key = "base_model.model.model.layers.29.self_attn.k_proj.lora_B.weight"
        assert torch.equal(loaded.layers[29]["k_proj"][1], f.get_tensor(key))
