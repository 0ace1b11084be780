"""engine.checkpoints.safetensors_view against the reference implementation (the safetensors
package): the same tensors from the same files, views rather than copies, and a refusal wherever
the reference refuses."""

from __future__ import annotations

import json
import random
import struct

import pytest
import safetensors.torch
import torch

from engine.checkpoints.safetensors_view import SafetensorsError, load_views


def _buffer(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _sample_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a.f32": torch.randn(4, 8, generator=g),
        "b.f16": torch.randn(3, 5, generator=g).half(),
        "c.bf16": torch.randn(7, generator=g).bfloat16(),
        "d.f64": torch.randn(2, 2, 2, generator=g).double(),
        "e.i32": torch.arange(6, dtype=torch.int32).reshape(2, 3),
        "f.u8": torch.arange(5, dtype=torch.uint8),
        "g.bool": torch.tensor([True, False, True]),
        "h.scalar": torch.tensor(3.5),
        "i.empty": torch.zeros(0, 4),
    }


def test_same_tensors_as_the_reference() -> None:
    data = safetensors.torch.save(_sample_tensors(), metadata={"format": "pt"})
    ours = load_views(_buffer(data))
    reference = safetensors.torch.load(data)
    assert ours.keys() == reference.keys()
    for name, tensor in reference.items():
        assert ours[name].dtype == tensor.dtype and ours[name].shape == tensor.shape, name
        assert torch.equal(ours[name], tensor), name


def test_aligned_tensors_are_views_of_the_buffer() -> None:
    tensors = {"x": torch.randn(16, 32), "y": torch.randn(8, 4)}
    buffer = _buffer(safetensors.torch.save(tensors))
    views = load_views(buffer)
    for name, view in views.items():
        assert view.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr(), name
    buffer.zero_()  # a view sees the buffer's bytes, not a copy of them
    assert not views["x"].any()


def test_misaligned_tensors_are_copied_correctly() -> None:
    # A header of odd length puts the data at an odd offset: no float32 view is possible.
    tensors = {"x": torch.randn(3, 3)}
    data = safetensors.torch.save(tensors)
    (header_len,) = struct.unpack("<Q", data[:8])
    header = data[8 : 8 + header_len].rstrip(b" ") + b" "
    if len(header) % 2 == 0:
        header += b" "
    data = struct.pack("<Q", len(header)) + header + data[8 + header_len :]
    views = load_views(_buffer(data))
    assert torch.equal(views["x"], tensors["x"])


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


def _header_file(header: dict, data: bytes) -> bytes:
    body = json.dumps(header).encode()
    return struct.pack("<Q", len(body)) + body + data


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"\x01\x00", r"too short"),
        (struct.pack("<Q", 1 << 40) + b"{}", r"the header claims \d+ bytes"),
        (struct.pack("<Q", 2) + b"[]", r"not a JSON object"),
        (struct.pack("<Q", 3) + b"{\xff}", r"not valid JSON"),
        (_header_file({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4),
         r"spans 4 bytes; F32 \[2\] takes 8"),
        (_header_file({"x": {"dtype": "Q9", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4),
         r"unknown dtype 'Q9'"),
        (_header_file({"x": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4),
         r"has shape \[-1\]"),
        (_header_file({"x": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8),
         r"starts at 4: it leaves a hole"),
        (_header_file({"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 8),
         r"cover 4 bytes of data; the file holds 8"),
        (_header_file({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4),
         r"past the end of the data"),
        (_header_file({"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "extra": 1}},
                      b"\0" * 4), r"exactly dtype, shape and data_offsets"),
        (_header_file({"__metadata__": {"a": 1}}, b""), r"__metadata__ must map names to strings"),
    ],
)  # fmt: skip
def test_malformed_files_are_refused(data: bytes, message: str) -> None:
    with pytest.raises(SafetensorsError, match=message):
        load_views(_buffer(data))


def test_duplicate_names_are_refused() -> None:
    entry = '{"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}'
    body = f'{{"x": {entry}, "x": {entry}}}'.encode()
    with pytest.raises(SafetensorsError, match=r"names 'x' twice"):
        load_views(_buffer(struct.pack("<Q", len(body)) + body + b"\0"))


def test_fuzzed_files_agree_with_the_reference() -> None:
    """Corrupted files: wherever the reference loads a file, ours loads the same tensors;
    wherever ours loads one, so does the reference. Every refusal is a SafetensorsError."""
    source = safetensors.torch.save(_sample_tensors())
    rng = random.Random(0)
    outcomes = {"loaded": 0, "refused": 0}
    for _ in range(600):
        data = bytearray(source)
        if rng.random() < 0.5:
            for _ in range(rng.randint(1, 6)):
                data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        else:
            (header_len,) = struct.unpack("<Q", data[:8])
            header = json.loads(data[8 : 8 + header_len])
            entry = header[rng.choice([k for k in header if k != "__metadata__"])]
            field = rng.choice(["dtype", "shape", "data_offsets"])
            entry[field] = rng.choice(
                {
                    "dtype": ["F16", "BF16", "F64", "I32", "BOOL", "U8", "I64", "X", 3],
                    "shape": [[], [8], [4, 8], [2, 16], [0], [-1, 4], [1.5], "x"],
                    "data_offsets": [[0, 0], [0, 16], [1, 2], [10**9, 10**9 + 4], [-4, 0]],
                }[field]
            )
            data = bytearray(_header_file(header, bytes(data[8 + header_len :])))
        try:
            reference = safetensors.torch.load(bytes(data))
        except Exception:
            reference = None
        try:
            ours = load_views(_buffer(bytes(data)))
        except SafetensorsError:
            ours = None
        if reference is None:
            assert ours is None, "loaded a file the reference refuses"
            outcomes["refused"] += 1
            continue
        assert ours is not None, "refused a file the reference loads"
        assert ours.keys() == reference.keys()
        for name, tensor in reference.items():
            assert ours[name].dtype == tensor.dtype and ours[name].shape == tensor.shape
            assert torch.equal(_bytes(ours[name]), _bytes(tensor)), name
        outcomes["loaded"] += 1
    assert outcomes["loaded"] > 50 and outcomes["refused"] > 100, outcomes
