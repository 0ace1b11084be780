"""PEFT LoRA adapters: a directory on disk -> validated `engine.lora.types.LoRAWeights`.

An adapter is the two files peft's `save_pretrained` writes:

    adapter_config.json        LoraConfig: peft_type, r, lora_alpha, target_modules, ...
    adapter_model.safetensors  base_model.model.model.layers.{i}.{block}.{module}.lora_{A|B}.weight

Adapters come from tenants, so both files are untrusted input. Whatever the
engine cannot apply exactly as peft would (`W x + scaling * B A x` on the seven
projections of the base model) is refused with an `AdapterError` that names the
file, the layer and module, and what was expected. No other exception escapes
`load_peft_adapter`, and it returns nothing half-validated.

Supported: plain LoRA and rsLoRA on q/k/v/o/gate/up/down_proj, any subset of
layers and modules, fp16/bf16/fp32/fp64 factors. Refused, each with its reason:
pickled weights, DoRA and the other LoRA variants, `modules_to_save`, biases,
per-layer or per-module selections (`layers_to_transform`, `layers_pattern`,
`rank_pattern`, `alpha_pattern`), and initialisations that modify the base
weights (PiSSA, OLoRA, CorDA, LoftQ).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

# Re-exported: the adapter's other file, and what load_peft_adapter raises.
from adapters.peft_config import CONFIG_FILE as CONFIG_FILE
from adapters.peft_config import AdapterError as AdapterError
from adapters.peft_config import LoraConfig, parse_config, short
from engine.checkpoints.safetensors_view import SafetensorsError, load_views
from engine.lora.types import LORA_TARGETS, LoRAWeights

WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_FILE = "adapter_model.bin"

# The decoder block each target lives in, in Hugging Face Llama names.
_BLOCK = {module: "self_attn" for module in LORA_TARGETS[:4]} | {
    module: "mlp" for module in LORA_TARGETS[4:]
}

# peft 0.21 writes `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`; older
# versions and some trainers keep the adapter's name before `.weight` (`lora_A.default.weight`).
# The layer index is bounded so that int() never sees a number too long to convert.
_TENSOR_KEY = re.compile(
    r"(?:base_model\.model\.)?model\.layers\.(?P<layer>\d{1,9})\.(?P<block>\w+)\."
    r"(?P<module>\w+)\.lora_(?P<side>[AB])(?:\.[\w-]+)?\.weight"
)

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# A config is a few KiB; anything near this size is not one.
_MAX_CONFIG_BYTES = 1 << 20
# Room for the safetensors header (tensor names, shapes, offsets) on top of the tensor data.
_HEADER_ALLOWANCE = 1 << 20


@dataclass(frozen=True, slots=True)
class BaseModelInfo:
    """What adapters are checked against: the base model's names, depth and projection shapes."""

    names: tuple[str, ...]
    num_layers: int
    # module -> (in_features, out_features), for every name in LORA_TARGETS.
    module_shapes: dict[str, tuple[int, int]]


def describe_base(model_dir: str | Path, extra_names: Iterable[str] = ()) -> BaseModelInfo:
    """The base model as adapters see it, from its config.json.

    It answers to the directory's name, the config's `_name_or_path` when present
    and `extra_names` (say, the name the server serves it under).
    """
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    try:
        hidden = int(config["hidden_size"])
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or hidden // heads)
        intermediate = int(config["intermediate_size"])
        num_layers = int(config["num_hidden_layers"])
    except KeyError as exc:
        raise ValueError(f"{model_dir / 'config.json'} has no {exc.args[0]!r}") from exc
    q_out, kv_out = heads * head_dim, kv_heads * head_dim
    module_shapes = {
        "q_proj": (hidden, q_out),
        "k_proj": (hidden, kv_out),
        "v_proj": (hidden, kv_out),
        "o_proj": (q_out, hidden),
        "gate_proj": (hidden, intermediate),
        "up_proj": (hidden, intermediate),
        "down_proj": (intermediate, hidden),
    }
    candidates = [model_dir.resolve().name, config.get("_name_or_path"), *extra_names]
    names = tuple(dict.fromkeys(n for n in candidates if isinstance(n, str) and n))
    return BaseModelInfo(names=names, num_layers=num_layers, module_shapes=module_shapes)


def adapter_identity(path: str | Path) -> str:
    """sha256 (hex) of the adapter's config and weights, each prefixed by its length.

    The length prefixes make the digest a function of the pair of files, not of
    their concatenation: bytes moved from one file to the other change it.
    """
    directory = _adapter_dir(path)
    digest = hashlib.sha256()
    for file in (directory / CONFIG_FILE, _weights_path(directory)):
        try:
            with file.open("rb") as stream:
                size = os.fstat(stream.fileno()).st_size
                digest.update(size.to_bytes(8, "big"))
                read = 0
                while chunk := stream.read(1 << 20):
                    digest.update(chunk)
                    read += len(chunk)
        except OSError as exc:
            raise AdapterError(f"cannot read {file.name}: {exc.strerror or exc}") from exc
        if read != size:
            raise AdapterError(f"{file.name} changed while it was being read")
    return digest.hexdigest()


def load_peft_adapter(
    path: str | Path, base: BaseModelInfo, max_lora_rank: int, expected_id: str | None = None
) -> LoRAWeights:
    """Read and validate a PEFT LoRA adapter directory; the factors come back as float32 CPU.

    `expected_id`, when given, is the identity recorded at registration: an
    adapter whose files changed since is refused rather than served under it.
    Raises AdapterError, and nothing else, for anything it refuses.
    """
    directory = _adapter_dir(path)
    weights_path = _weights_path(directory)
    config_bytes = _read_bounded(
        directory / CONFIG_FILE, _MAX_CONFIG_BYTES, "no adapter config is that large"
    )
    config = parse_config(config_bytes, max_lora_rank)
    _check_base_model(config.base_model, base)
    weights = _read_weights(
        weights_path,
        _max_weights_bytes(base, config.rank),
        f"no rank-{config.rank} adapter of this base model is that large",
    )
    # The identity is computed from the very bytes that are parsed, so a file replaced while
    # it is loaded cannot be served under the identity of the one it replaced. sha256
    # releases the GIL: it runs beside the parsing, which is the other half of a load.
    # A thread of this load's own, gone when it ends (no pool outlives its loads).
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="adapter-sha256") as hasher:
        digest = hasher.submit(_digest, config_bytes, weights)
        try:
            layers = _pair_factors(_parse_weights(weights), config, base)
        finally:
            adapter_id = digest.result()
    if expected_id is not None and adapter_id != expected_id:
        raise AdapterError(
            f"adapter files changed since registration: sha256 is {adapter_id}, "
            f"registered as {expected_id}"
        )
    return LoRAWeights(
        adapter_id=adapter_id, rank=config.rank, scaling=config.scaling, layers=layers
    )


# --- files -----------------------------------------------------------------------------


def _adapter_dir(path: str | Path) -> Path:
    directory = Path(path)
    if not directory.is_dir():
        raise AdapterError(f"no adapter directory at {str(path)!r}")
    if not (directory / CONFIG_FILE).is_file():
        raise AdapterError(f"{CONFIG_FILE} is missing from the adapter directory")
    return directory


def _weights_path(directory: Path) -> Path:
    path = directory / WEIGHTS_FILE
    if path.is_file():
        return path
    if (directory / PICKLE_FILE).exists():
        raise AdapterError(
            f"{PICKLE_FILE} is refused: it is a Python pickle, and unpickling can run arbitrary "
            f"code. Convert it to {WEIGHTS_FILE} where you trust it, e.g. "
            f"safetensors.torch.save_file(torch.load(path, weights_only=True), "
            f"'{WEIGHTS_FILE}')"
        )
    raise AdapterError(f"{WEIGHTS_FILE} is missing from the adapter directory")


def _read_bounded(path: Path, limit: int, why: str) -> bytes:
    try:
        with path.open("rb") as stream:
            data = stream.read(limit + 1)
    except OSError as exc:
        raise AdapterError(f"cannot read {path.name}: {exc.strerror or exc}") from exc
    if len(data) > limit:
        raise AdapterError(f"{path.name} is over {limit} bytes: {why}")
    return data


def _read_weights(path: Path, limit: int, why: str) -> torch.Tensor:
    """The file's bytes in one uint8 tensor, which the factors will be views of."""
    try:
        with path.open("rb", buffering=0) as stream:
            size = os.fstat(stream.fileno()).st_size
            if size > limit:
                raise AdapterError(f"{path.name} is over {limit} bytes: {why}")
            buffer = torch.empty(size, dtype=torch.uint8)
            view = buffer.numpy().data
            read = 0
            while read < size and (count := stream.readinto(view[read:])):
                read += count
            grew = bool(stream.read(1))
    except OSError as exc:
        raise AdapterError(f"cannot read {path.name}: {exc.strerror or exc}") from exc
    if read != size or grew:
        raise AdapterError(f"{path.name} changed while it was being read")
    return buffer


def _max_weights_bytes(base: BaseModelInfo, rank: int) -> int:
    """The largest file a valid adapter can be: every module of every layer, in float64."""
    per_rank = sum(inp + out for inp, out in base.module_shapes.values())
    return rank * per_rank * base.num_layers * 8 + _HEADER_ALLOWANCE


def _digest(config_bytes: bytes, weights: torch.Tensor) -> str:
    digest = hashlib.sha256()
    for data in (memoryview(config_bytes), weights.numpy().data):
        digest.update(data.nbytes.to_bytes(8, "big"))
        digest.update(data)
    return digest.hexdigest()


def _check_base_model(trained_for: str | None, base: BaseModelInfo) -> None:
    """Compare by the last path component: a hub id and a local directory of it agree."""
    if trained_for is None or not base.names:
        return
    known = {_last_component(name).lower() for name in base.names}
    if _last_component(trained_for).lower() not in known:
        also = f" (also known as {', '.join(map(repr, base.names[1:]))})" if base.names[1:] else ""
        raise AdapterError(
            f"adapter was trained for {short(trained_for)}, not for base model "
            f"{base.names[0]!r}{also}"
        )


def _last_component(name: str) -> str:
    return name.replace("\\", "/").rstrip("/").rsplit("/", 1)[-1]


# --- adapter_model.safetensors -----------------------------------------------------------


def _parse_weights(data: torch.Tensor) -> dict[str, torch.Tensor]:
    try:
        return load_views(data)
    except SafetensorsError as exc:
        raise AdapterError(f"{WEIGHTS_FILE} is not a valid safetensors file: {exc}") from exc


def _pair_factors(
    tensors: dict[str, torch.Tensor], config: LoraConfig, base: BaseModelInfo
) -> list[dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """Group lora_A/lora_B by (layer, module), check each pair, convert to float32."""
    found: dict[tuple[int, str], dict[str, tuple[str, torch.Tensor]]] = {}
    for key, tensor in tensors.items():
        layer, module, side = _locate(key, base.num_layers)
        if config.target_modules is not None and not _listed(layer, module, config.target_modules):
            raise AdapterError(
                f"{WEIGHTS_FILE}: tensor {short(key, 120)} adapts {module}, which target_modules "
                f"{list(config.target_modules)} does not include"
            )
        pair = found.setdefault((layer, module), {})
        if side in pair:
            raise AdapterError(
                f"{WEIGHTS_FILE}: layer {layer} {module} has two lora_{side} tensors: "
                f"{short(pair[side][0], 120)} and {short(key, 120)}"
            )
        pair[side] = (key, tensor)
    if not found:
        raise AdapterError(f"{WEIGHTS_FILE} holds no LoRA tensors")

    layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = [
        {} for _ in range(base.num_layers)
    ]
    names: list[tuple[str, str]] = []  # (what, tensor key), in the order of the factors
    for layer, module in sorted(found, key=lambda lm: (lm[0], LORA_TARGETS.index(lm[1]))):
        pair = found[(layer, module)]
        where = f"layer {layer} {module}"
        if len(pair) == 1:
            (present,) = pair
            missing = "B" if present == "A" else "A"
            raise AdapterError(
                f"{WEIGHTS_FILE}: {where} has lora_{present} but no lora_{missing}; "
                f"both factors are needed"
            )
        in_features, out_features = base.module_shapes[module]
        a = _factor(pair["A"], (config.rank, in_features), f"{where} lora_A", "r, in_features")
        b = _factor(pair["B"], (out_features, config.rank), f"{where} lora_B", "out_features, r")
        layers[layer][module] = (a, b)
        names += [(f"{where} lora_A", pair["A"][0]), (f"{where} lora_B", pair["B"][0])]
    _check_finite(
        [t for layer_factors in layers for pair in layer_factors.values() for t in pair], names
    )
    return layers


def _check_finite(factors: list[torch.Tensor], names: list[tuple[str, str]]) -> None:
    """One fused pass over every factor (a NaN or inf makes its norm non-finite); the
    slow per-tensor search runs only to name the culprit."""
    norms = torch.stack(torch._foreach_norm(factors))
    if bool(torch.isfinite(norms).all()):
        return
    for tensor, (what, key) in zip(factors, names, strict=True):
        if not bool(torch.isfinite(tensor).all()):
            raise AdapterError(
                f"{WEIGHTS_FILE}: {what} ({short(key, 120)}) holds NaN or infinite values"
            )
    raise AdapterError(f"{WEIGHTS_FILE}: factor values too large for float32 arithmetic")


def _listed(layer: int, module: str, target_modules: tuple[str, ...]) -> bool:
    """peft's rule for a list: an entry is the module's full name or a dotted suffix of it."""
    full_name = f"model.layers.{layer}.{_BLOCK[module]}.{module}"
    return any(full_name == t or full_name.endswith("." + t) for t in target_modules)


def _locate(key: str, num_layers: int) -> tuple[int, str, str]:
    """(layer, module, "A" or "B") of a tensor name, or an AdapterError saying why not."""
    match = _TENSOR_KEY.fullmatch(key)
    if match is None or _BLOCK.get(match["module"]) != match["block"]:
        raise AdapterError(
            f"{WEIGHTS_FILE}: tensor {short(key, 120)} is not a lora_A/lora_B weight of "
            f"{', '.join(LORA_TARGETS)} in a decoder layer"
        )
    layer = int(match["layer"])
    if layer >= num_layers:
        raise AdapterError(
            f"{WEIGHTS_FILE}: tensor {short(key, 120)} is for layer {layer}, but the base "
            f"model has {num_layers} layers (0..{num_layers - 1})"
        )
    return layer, match["module"], match["side"]


def _factor(
    named: tuple[str, torch.Tensor], expected: tuple[int, int], what: str, dims: str
) -> torch.Tensor:
    key, tensor = named
    if tensor.dtype not in _FLOAT_DTYPES:
        raise AdapterError(
            f"{WEIGHTS_FILE}: {what} ({short(key, 120)}) has dtype {tensor.dtype}; "
            f"expected float16, bfloat16, float32 or float64"
        )
    if tuple(tensor.shape) != expected:
        raise AdapterError(
            f"{WEIGHTS_FILE}: {what} ({short(key, 120)}) has shape {list(tensor.shape)}; expected "
            f"{list(expected)} = [{dims}]"
        )
    # float32 factors stay views of the buffer the file was read into (nothing writes to
    # them; the engine copies them into its slots): a copy here would be the load's largest.
    return tensor.to(torch.float32).contiguous()
