"""Every offline benchmark runs end to end at toy size on the demo model, so that none rots
between the sessions that measure with it. The figures mean nothing here; the tables must
come out whole. (`serve`, `tools` and `upload` drive a server and `vs-vllm` needs vLLM: their
option parsing is checked in test_bench_cli.py; `kernels --toy` in test_kernels_bench.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.__main__ import main

TOY_RUNS = {
    "offline": ["--num-prompts", "4", "--output-len", "4", "--batch-size", "4"],
    "lora": [
        "--num-adapters", "2", "--num-prompts", "4", "--output-len", "4", "--batch-size", "4",
        "--repeat", "1",
    ],
    "containment": ["--batches", "4", "--output-len", "12", "--fail-at", "4", "--repeat", "1"],
    "guided": ["--num-prompts", "4", "--output-len", "24"],
    "spec-decode": ["--repeat", "1", "--max-num-seqs", "2", "--dtype", "float32"],
    "quantization": ["--repeat", "1", "--max-tokens", "4", "--dtype", "float32"],
    "agreement": ["--max-tokens", "4", "--dtype", "float32"],
    "fairness": ["--duration", "1", "--drain", "10", "--output-len", "4"],
}  # fmt: skip


@pytest.mark.parametrize("name", list(TOY_RUNS))
def test_each_benchmark_runs_at_toy_size(
    name: str, demo_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [name, "--model", str(demo_model_dir), *TOY_RUNS[name]]
    if name == "lora":
        args += ["--adapters-dir", str(tmp_path / "adapters")]
    main(args)
    out = capsys.readouterr().out
    assert "┃" in out or "|" in out, out[-2000:]  # a table was printed
