"""A safetensors file already in memory -> its tensors as views of that memory, checked strictly.

`safetensors.torch.load` copies every tensor out of the bytes it is given (twice:
into Python bytes, then into a tensor). An adapter load reads its file into one
buffer and only ever copies the factors once more, into the engine's slot layout,
so here the tensors are views of the buffer: loading a rank-16 SmolLM2 adapter
(20 MB) saves two 20 MB copies and the page faults of two fresh allocations.

The format (https://github.com/huggingface/safetensors): an 8-byte little-endian
header length N, N bytes of JSON (`name -> {dtype, shape, data_offsets}` plus an
optional `__metadata__` of strings, padded with spaces), then the data. This
parser refuses what the reference implementation refuses: offsets that leave a
hole or overlap, sizes that disagree with shape and dtype, unknown dtypes,
duplicate names, a header past the end of the file.
"""

from __future__ import annotations

import json
import math
from typing import Any

import torch

# The reference implementation's limit; an adapter's header is a few tens of KiB.
MAX_HEADER_BYTES = 100_000_000

DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E4M3": torch.float8_e4m3fn,
    "I16": torch.int16,
    "U16": torch.uint16,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "F32": torch.float32,
    "I64": torch.int64,
    "U64": torch.uint64,
    "F64": torch.float64,
}


class SafetensorsError(ValueError):
    """The buffer is not a well-formed safetensors file; the message says where."""


def load_views(buffer: torch.Tensor) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file held in `buffer` (1-D uint8), as views of it.

    A tensor whose offset is not a multiple of its element size cannot be a view
    and is copied. The views share the buffer's memory: whoever keeps one keeps
    the whole buffer alive, and writing to one writes to the buffer.
    """
    if buffer.dtype != torch.uint8 or buffer.dim() != 1:
        raise TypeError("load_views takes a 1-D uint8 tensor")
    size = buffer.numel()
    if size < 8:
        raise SafetensorsError(f"{size} bytes is too short for the 8-byte header length")
    header_len = int.from_bytes(buffer[:8].numpy().tobytes(), "little")
    if header_len > min(MAX_HEADER_BYTES, size - 8):
        raise SafetensorsError(
            f"the header claims {header_len} bytes; the file has {size - 8} after the length"
        )
    header = _parse_header(buffer[8 : 8 + header_len].numpy().tobytes())
    data = buffer[8 + header_len :]
    entries = sorted(
        ((name, _entry(name, spec)) for name, spec in header.items() if name != "__metadata__"),
        key=lambda item: item[1][2:],  # (begin, end): an empty tensor sorts first
    )
    tensors: dict[str, torch.Tensor] = {}
    expected_begin = 0
    for name, (dtype, shape, begin, end) in entries:
        if begin != expected_begin:
            what = "overlaps the tensor before it" if begin < expected_begin else "leaves a hole"
            raise SafetensorsError(f"tensor {name!r} starts at {begin}: it {what}")
        expected_begin = end
        if end > data.numel():
            raise SafetensorsError(
                f"tensor {name!r} ends at {end}, past the end of the data ({data.numel()} bytes)"
            )
        raw = data[begin:end]
        if raw.storage_offset() % dtype.itemsize:
            raw = raw.clone()  # misaligned for a view: copy this one tensor
        tensors[name] = raw.view(dtype).view(shape)
    if expected_begin != data.numel():
        raise SafetensorsError(
            f"the tensors cover {expected_begin} bytes of data; the file holds {data.numel()}"
        )
    return tensors


def _parse_header(raw: bytes) -> dict[str, Any]:
    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        result = dict(pairs)
        if len(result) != len(pairs):
            names = [name for name, _ in pairs]
            duplicate = next(n for n in names if names.count(n) > 1)
            raise SafetensorsError(f"the header names {duplicate!r} twice")
        return result

    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=no_duplicates)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        if isinstance(exc, SafetensorsError):
            raise
        raise SafetensorsError(f"the header is not valid JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise SafetensorsError("the header is not a JSON object")
    metadata = header.get("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise SafetensorsError("__metadata__ must map names to strings")
    return header


def _entry(name: str, spec: Any) -> tuple[torch.dtype, tuple[int, ...], int, int]:
    """(dtype, shape, begin, end) of one header entry, each checked."""
    if not isinstance(spec, dict) or set(spec) != {"dtype", "shape", "data_offsets"}:
        raise SafetensorsError(
            f"tensor {name!r}: an entry holds exactly dtype, shape and data_offsets"
        )
    dtype = DTYPES.get(spec["dtype"]) if isinstance(spec["dtype"], str) else None
    if dtype is None:
        raise SafetensorsError(f"tensor {name!r} has unknown dtype {spec['dtype']!r}")
    shape, offsets = spec["shape"], spec["data_offsets"]
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise SafetensorsError(f"tensor {name!r} has shape {shape!r}; expected a list of sizes")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_count, offsets))):
        raise SafetensorsError(f"tensor {name!r} has data_offsets {offsets!r}")
    begin, end = offsets
    if end < begin:
        raise SafetensorsError(f"tensor {name!r} ends at {end}, before it begins at {begin}")
    nbytes = math.prod(shape) * dtype.itemsize
    if end - begin != nbytes:
        raise SafetensorsError(
            f"tensor {name!r} spans {end - begin} bytes; {spec['dtype']} {shape} takes {nbytes}"
        )
    return dtype, tuple(shape), begin, end


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
