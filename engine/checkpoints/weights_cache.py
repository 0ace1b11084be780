"""The weights as the engine runs them, written once per checkpoint and mapped afterwards.

A load from the checkpoint converts every tensor to the compute dtype, fuses q/k/v and
gate/up into fresh memory, then reorders each linear into its GEMM kernel's layout (oneDNN's
blocked one, or kernels/linear.py's panels) in more fresh memory: SmolLM2 on Zen 4 spends
0.36 s of a 0.48 s cold start there, all of it CPU, and four models starting at once on two
cores queue behind each other's copies. The first load writes the result to one file; later
loads map that file and rebuild each reordered weight over its bytes (a view for panels,
kernels/csrc/packed_weight.cpp for oneDNN's): no copy, no conversion, and engines
of the same checkpoint (replicas, a restart, the next cold start) share its pages in the
page cache instead of holding a copy each. ServerlessLLM loads from a loading-optimized
checkpoint format for the same reason.

The file: 8 bytes of little-endian header length, a JSON header (the fingerprint and one
entry per tensor), then the tensors at 64-byte aligned offsets. The fingerprint covers
what the bytes depend on: the checkpoint's files (size and modification time), the dtype,
whether weights are reordered and into which layout, torch's version (oneDNN's layouts) and
the CPU's flags (the layout oneDNN picks for them). A file that does not match, or does not
parse, is a miss: the engine loads from the checkpoint and writes the file again. A directory
that cannot be written is a warning, never a failed start. The mapping is private and
writable, so a write to a weight (none is expected) would copy a page, not change the file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import platform
import struct
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from engine.checkpoints.checkpoint_map import safetensors_files
from engine.checkpoints.safetensors_view import DTYPES
from engine.config import EngineConfig
from kernels import cpu_features, linear

logger = logging.getLogger(__name__)

FORMAT = 2  # 2: each reordered entry names its layout
ALIGN = 64  # a cache line: oneDNN's AVX-512 loads of a weight start on one
MAX_HEADER_BYTES = 64 << 20
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def cache_for(config: EngineConfig, device: torch.device) -> WeightsCache | None:
    """The engine's weights cache, where its weights can be kept as it runs them: on the CPU
    and not quantized at load (SmoothQuant depends on the calibration text)."""
    if config.quantization is not None or device.type != "cpu":
        return None
    return weights_cache_at(config.weights_cache_dir)


def weights_cache_at(setting: str) -> WeightsCache | None:
    """The engine's `weights_cache_dir`: auto (~/.cache/loragate/weights), a directory, or
    none."""
    if setting.strip().lower() in ("none", "off", ""):
        return None
    if setting == "auto":
        return WeightsCache(Path.home() / ".cache" / "loragate" / "weights")
    return WeightsCache(Path(setting).expanduser())


def _aligned(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


def _layout(dtype: torch.dtype) -> str | None:
    packer = linear.packer(dtype)
    return None if packer is None else packer.layout


def fingerprint(model_dir: Path, dtype: torch.dtype, reordered: bool) -> str:
    files = []
    for file in [*safetensors_files(model_dir), model_dir / "config.json"]:
        if file.exists():
            stat = file.stat()
            files.append((file.name, stat.st_size, stat.st_mtime_ns))
    facts = {
        "format": FORMAT,
        "files": files,
        "dtype": str(dtype),
        "reordered": reordered,
        "layout": _layout(dtype) if reordered else None,
        "layouts": sorted(linear.LAYOUTS),  # a layout added since (gate/up panels) rewrites
        "batch_hint": linear.BATCH_HINT,
        "torch": torch.__version__,
        "machine": platform.machine(),
        "cpu": cpu_features.flags_line(),
        # oneDNN's layout follows the instruction set it may use, which these cap.
        "isa": [os.environ.get(name, "") for name in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")],
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True)
class WeightsCache:
    """One file per model directory and dtype under `root`; a newer fingerprint replaces it."""

    root: Path

    def path(self, model_dir: Path, dtype: torch.dtype) -> Path:
        key = hashlib.sha256(f"{model_dir.resolve()}\0{dtype}".encode()).hexdigest()[:16]
        return self.root / f"{model_dir.resolve().name}-{key}.weights"

    def load(self, model: nn.Module, model_dir: Path, dtype: torch.dtype, reordered: bool) -> bool:
        """Fill `model` (built, parameters unfilled) from its file; False on a miss, the model
        then untouched."""
        path = self.path(model_dir, dtype)
        try:
            with path.open("rb") as f:
                size = f.seek(0, 2)
                if size < 8:
                    return False
                mapping = mmap.mmap(
                    f.fileno(),
                    size,
                    flags=mmap.MAP_PRIVATE,
                    prot=mmap.PROT_READ | mmap.PROT_WRITE,
                )
        except OSError:
            return False
        buffer = torch.frombuffer(mapping, dtype=torch.uint8)
        try:
            header, start = _read_header(buffer)
            if header.get("fingerprint") != fingerprint(model_dir, dtype, reordered):
                return False
            _place(model, buffer[start:], header["entries"])
        except (ValueError, KeyError, TypeError, RuntimeError) as exc:
            logger.warning("weights cache %s unusable, loading the checkpoint: %s", path, exc)
            return False
        return True

    def save(self, model: nn.Module, model_dir: Path, dtype: torch.dtype, reordered: bool) -> bool:
        """Write `model`'s weights as they are now (loaded, reordered); False, with a warning,
        where the file cannot be written."""
        path = self.path(model_dir, dtype)
        entries: list[dict[str, Any]] = []
        chunks: list[tuple[int, memoryview]] = []
        offset = 0
        for weight in _weights(model):
            offset = _aligned(offset)
            entry = {
                "name": weight.name,
                "kind": weight.kind,
                "dtype": _DTYPE_NAMES[weight.dtype],
                "shape": weight.shape,
                "offset": offset,
                "nbytes": len(weight.data),
            }
            if weight.layout is not None:
                entry["layout"] = weight.layout
            if weight.descriptor is not None:
                entry["descriptor"] = weight.descriptor.numpy().tobytes().hex()
            entries.append(entry)
            chunks.append((offset, weight.data))
            offset += len(weight.data)
        header = json.dumps(
            {
                "fingerprint": fingerprint(model_dir, dtype, reordered),
                "model": str(model_dir.resolve()),
                "entries": entries,
            }
        ).encode()
        start = _aligned(8 + len(header))
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            # Written aside and renamed: an engine mapping the old file keeps it, a reader
            # never sees half a file, and of two engines writing at once the last one wins.
            fd, temporary = tempfile.mkstemp(dir=self.root, prefix=".", suffix=".partial")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(struct.pack("<Q", len(header)) + header)
                    for chunk_offset, data in chunks:
                        f.seek(start + chunk_offset)
                        f.write(data)
                os.replace(temporary, path)
            except BaseException:
                Path(temporary).unlink(missing_ok=True)
                raise
            self._remove_orphans()
        except OSError as exc:
            logger.warning(
                "weights cache: cannot write %s (%s); loading from the checkpoint each time",
                path,
                exc,
            )
            return False
        return True

    def _remove_orphans(self) -> None:
        """Files whose checkpoint directory is gone (a model deleted, a test's temporary copy):
        nothing would map them again."""
        for file in self.root.glob("*.weights"):
            try:
                with file.open("rb") as f:
                    (length,) = struct.unpack("<Q", f.read(8))
                    model = json.loads(f.read(min(length, MAX_HEADER_BYTES))).get("model")
            except (OSError, ValueError, struct.error, AttributeError):
                continue  # being written, or not ours to judge
            if isinstance(model, str) and not Path(model).is_dir():
                file.unlink(missing_ok=True)


class _Weight(NamedTuple):
    name: str
    kind: str  # reordered (a PrepackedLinear's weight), bias (a reordered linear's), parameter
    data: memoryview
    shape: list[int]  # a reordered weight's: [out_features, in_features]
    dtype: torch.dtype
    layout: str | None = None  # a reordered weight's (kernels.linear.LAYOUTS)
    descriptor: torch.Tensor | None = None  # and what its layout needs to rebuild it


def _weights(model: nn.Module) -> Iterator[_Weight]:
    """Every weight the engine runs with: each reordered linear and its bias, then every
    remaining parameter."""
    for name, module in model.named_modules():
        if isinstance(module, linear.PrepackedLinear):
            data, descriptor = module.to_bytes()
            shape = [module.out_features, module.in_features]
            dtype = module.packed.dtype
            yield _Weight(name, "reordered", data, shape, dtype, module.layout, descriptor)
            if module.bias is not None:
                bias = module.bias
                yield _Weight(name, "bias", _plain_bytes(bias), list(bias.shape), bias.dtype)
    for name, param in model.named_parameters():
        yield _Weight(name, "parameter", _plain_bytes(param), list(param.shape), param.dtype)


def _plain_bytes(tensor: torch.Tensor) -> memoryview:
    flat: Any = tensor.detach().contiguous().view(torch.uint8).reshape(-1).numpy()
    return memoryview(flat)


def _read_header(buffer: torch.Tensor) -> tuple[dict[str, Any], int]:
    """The header, and the offset where the tensors start."""
    (length,) = struct.unpack("<Q", buffer[:8].numpy().tobytes())
    if length > buffer.numel() - 8:
        raise ValueError("header runs past the end of the file")
    header = json.loads(buffer[8 : 8 + length].numpy().tobytes())
    if not isinstance(header, dict):
        raise ValueError("header is not an object")
    return header, _aligned(8 + length)


def _place(model: nn.Module, data: torch.Tensor, entries: list[dict[str, Any]]) -> None:
    """Every entry into the model, as views of `data` (the file past its header). Everything
    is checked before the model is touched: an entry that does not fit raises and leaves the
    model as it was."""
    modules = dict(model.named_modules())

    def view(entry: dict[str, Any]) -> torch.Tensor:
        begin = int(entry["offset"])
        end = begin + int(entry["nbytes"])
        if begin < 0 or end > data.numel():
            raise ValueError(f"{entry['name']}: bytes past the end of the file")
        return data[begin:end]

    def typed(entry: dict[str, Any]) -> torch.Tensor:
        return view(entry).view(DTYPES[entry["dtype"]]).view(entry["shape"])

    biases = {e["name"]: typed(e) for e in entries if e["kind"] == "bias"}
    replacements: list[tuple[str, linear.PrepackedLinear]] = []
    for entry in (e for e in entries if e["kind"] == "reordered"):
        module = modules.get(entry["name"])
        shape = entry["shape"]
        # A linear as built, or reordered already (this engine's own, mapped once written).
        linears = (nn.Linear, linear.PrepackedLinear)
        if not isinstance(module, linears) or [module.out_features, module.in_features] != shape:
            raise ValueError(f"{entry['name']}: no linear of shape {shape} to place")
        if (module.bias is None) != (entry["name"] not in biases):
            raise ValueError(f"{entry['name']}: the file and the model disagree on a bias")
        layout = linear.LAYOUTS.get(entry.get("layout", ""))
        if layout is None:
            raise ValueError(f"{entry['name']}: no layout {entry.get('layout')!r} here")
        descriptor = None
        if "descriptor" in entry:
            descriptor = torch.tensor(list(bytes.fromhex(entry["descriptor"])), dtype=torch.uint8)
        sizes = (int(shape[0]), int(shape[1]))
        packed = layout.from_bytes(view(entry), sizes, DTYPES[entry["dtype"]], descriptor)
        replacement = layout(packed, biases.get(entry["name"]), sizes, keep=data)
        replacements.append((entry["name"], replacement))
    replaced = {name for name, _ in replacements}
    params = {
        name: param
        for name, param in model.named_parameters()
        if name.rpartition(".")[0] not in replaced
    }
    fills: dict[str, torch.Tensor] = {}
    for entry in (e for e in entries if e["kind"] == "parameter"):
        param = params.get(entry["name"])
        tensor = typed(entry)
        if param is None or param.shape != tensor.shape or param.dtype != tensor.dtype:
            raise ValueError(f"{entry['name']}: no parameter of shape {entry['shape']} to fill")
        fills[entry["name"]] = tensor
    missing = sorted(set(params) - set(fills))
    if missing:
        raise ValueError(f"parameters missing from the file: {missing[:5]}")
    for name, replacement in replacements:
        parent_name, _, attr = name.rpartition(".")
        setattr(modules[parent_name] if parent_name else model, attr, replacement)
    for name, tensor in fills.items():
        params[name].data = tensor
