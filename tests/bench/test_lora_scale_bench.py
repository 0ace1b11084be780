"""`loragate-bench lora-scale` at toy size on the demo model, so that it cannot rot: S-LoRA's
trace over a catalog of 40 adapters, 24 requests of at most 32 + 16 tokens, 4 device slots.
The figures mean nothing here; the work each run does, the adapters it touches and the
tables must be what was asked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rich_tables import rows_starting

from bench.__main__ import main
from bench.lora_scale import parse_size
from bench.lora_scale_trace import TraceSpec, catalog_ranks, make_trace
from bench.lora_scale_verify import first_difference, pick_requests

TOY = [
    "--num-adapters", "40", "--num-requests", "24", "--max-input", "32", "--max-output", "16",
    "--max-loras", "4", "--threads", "1",
]  # fmt: skip
WHERE = ("slot", "cpu", "disk", "base")


def test_lora_scale_at_toy_size(
    demo_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """All at once, then again with Poisson arrivals, peft, and (a) checked token for token
    against peft, on the adapter files the first run wrote (the second writes none)."""
    store, out = tmp_path / "adapters", tmp_path / "lora-scale.json"
    args = ["lora-scale", "--model", str(demo_model_dir), *TOY, "--adapters-dir", str(store)]
    main([*args, "--json", str(out)])
    result = json.loads(out.read_text())
    runs = result["runs"]
    assert list(runs) == ["(a) mixed", "(b) one r16", "(c) base"]
    touched = result["touched"]
    assert 1 < touched <= 24
    [folder] = store.iterdir()
    assert len(list(folder.iterdir())) == touched + 1  # files for the touched and the r16 one
    work = {run["output_tokens"] for run in runs.values()}
    assert len(work) == 1 and work.pop() >= 24 * 8  # the same work, every token asked for
    for run in runs.values():
        assert run["errors"] == 0 and run["unserved"] == 0
        assert sum(group["n"] for group in run["ttft_s"].values()) == 24
    mixed = runs["(a) mixed"]
    assert mixed["disk_loads"] == touched  # each read once: they all fit the CPU cache (16)
    assert set(mixed["ttft_s"]) <= {"disk", "base"}  # all at once: nothing was loaded yet
    assert runs["(b) one r16"]["disk_loads"] == 1 and runs["(c) base"]["loads"] == 0
    printed = capsys.readouterr().out
    assert f"{touched} touched" in printed and f"files for the {touched}" in printed
    assert rows_starting(printed, "(a) mixed") and "(a)/(b) output tok/s" in printed

    check = ["--verify-peft", "6", "--verify-max-output", "8"]
    main([*args, "--rate", "200", "--skip-base", "--peft", *check, "--json", str(out)])
    printed = capsys.readouterr().out
    assert f"(0 written, {touched + 1} reused)" in printed
    verified = json.loads(out.read_text())["verify_peft"]
    assert verified["checked"] == verified["equal"] == 6 and verified["first_mismatch"] is None
    assert "6 of 6 equal peft, the first 8 tokens of each" in printed
    assert "the engine in float32 (--dtype auto overridden)" in printed
    assert [row[0] for row in rows_starting(printed, "(d) peft mixed")] == ["(d) peft mixed"]
    ttft_rows = [row for row in rows_starting(printed, "(a) mixed") if row[1] in WHERE]
    assert ttft_rows  # the TTFT table has (a)'s groups


def test_the_trace_is_seeded_and_follows_its_spec() -> None:
    spec = TraceSpec(
        num_adapters=50, ranks=(8, 64), num_tenants=10, num_requests=400, alpha=1.0,
        base_fraction=0.05, input_len=(8, 40), output_len=(8, 30), max_model_len=48, rate=10.0,
        seed=3,
    )  # fmt: skip
    trace = make_trace(spec, vocab_size=1000, special_ids=[0, 1, 2])
    assert trace == make_trace(spec, vocab_size=1000, special_ids=[0, 1, 2])
    assert catalog_ranks(20, (8, 64), 3) == trace.catalog_ranks[:20]  # a smaller catalog's
    assert set(trace.catalog_ranks) == {8, 64}
    for prompt, out in zip(trace.prompts, trace.output_lens, strict=True):
        assert 8 <= len(prompt) <= 40 and 1 <= out <= 30 and len(prompt) + out <= 48
        assert not {0, 1, 2} & set(prompt)
    assert trace.arrivals[0] == 0 and trace.arrivals == sorted(trace.arrivals)
    adapted = [a for a in trace.adapters if a is not None]
    assert 0 < len(trace.adapters) - len(adapted) < 40  # about 5 % on the base model
    assert adapted.count(0) > adapted.count(1) > adapted.count(10)  # popularity by index


def test_verify_peft_draws_adapted_requests_and_needs_float32(demo_model_dir: Path) -> None:
    spec = TraceSpec(
        num_adapters=50, ranks=(8, 64), num_tenants=10, num_requests=100, alpha=1.0,
        base_fraction=0.2, input_len=(8, 16), output_len=(8, 16), max_model_len=48, rate=0.0,
        seed=5,
    )  # fmt: skip
    trace = make_trace(spec, vocab_size=1000, special_ids=[0])
    picks = pick_requests(trace, 30, seed=5)
    assert picks == pick_requests(trace, 30, seed=5) == sorted(set(picks)) and len(picks) == 30
    assert all(trace.adapters[i] is not None for i in picks)
    adapted = [i for i, a in enumerate(trace.adapters) if a is not None]
    assert pick_requests(trace, 1000, seed=5) == adapted  # K above the pool: all of it
    assert first_difference([1, 2, 3], [1, 2, 3, 9], 3) is None
    assert first_difference([1, 2, 3], [1, 5, 3], 3) == (1, 2, 5)
    assert first_difference([1], [1, 4], 2) == (1, None, 4)  # the engine's output ended
    model = ["lora-scale", "--model", str(demo_model_dir), "--verify-peft", "2"]
    with pytest.raises(SystemExit, match="needs float32: drop --dtype bfloat16"):
        main([*model, "--dtype", "bfloat16"])
    with pytest.raises(SystemExit, match="goes with --verify-peft"):
        main([*model[:3], "--verify-max-output", "4"])


def test_sizes_parse_in_powers_of_1024() -> None:
    assert parse_size("2GiB") == 2 << 30 and parse_size("512MiB") == 512 << 20
    assert parse_size("1.5G") == 3 << 29 and parse_size("1048576") == 1 << 20


def test_lora_scale_over_http_without_vllm(
    demo_model_dir: Path, tmp_path: Path, tcp_port: int
) -> None:
    """`lora-scale-vs-vllm --skip-vllm`: the trace's requests, each on its adapter's name, all
    answered by `loragate serve` serving the touched adapters as --lora-modules."""
    out = tmp_path / "vs-vllm.json"
    args = ["lora-scale-vs-vllm", "--model", str(demo_model_dir), "--num-adapters", "40"]
    args += ["--num-requests", "12", "--max-input", "32", "--max-output", "8", "--skip-vllm"]
    args += ["--max-loras", "4", "--max-cpu-loras", "4", "--lora-memory", "64MiB"]
    args += ["--port", str(tcp_port)]
    main([*args, "--adapters-dir", str(tmp_path / "adapters"), "--json", str(out)])
    [ours] = json.loads(out.read_text())
    assert ours["side"] == "loragate" and ours["failed"] == 0, ours
    assert ours["output_tokens"] >= 12 * 8 and ours["tok_s"] > 0
