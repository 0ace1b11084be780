"""`loragate-bench` (bench/__main__.py): every benchmark is reachable and parses its options,
and the product's import graph never reaches bench/."""

from __future__ import annotations

import subprocess
import sys

import pytest

from bench.__main__ import BENCHMARKS, _without_option, main


def test_the_listing_names_every_benchmark(capsys: pytest.CaptureFixture[str]) -> None:
    main(["--help"])
    out = capsys.readouterr().out
    assert all(f"  {name} " in out for name in BENCHMARKS)


@pytest.mark.parametrize("name", list(BENCHMARKS))
def test_each_benchmark_imports_and_answers_help(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main([name, "--help"])
    assert exit_.value.code == 0
    assert "usage:" in capsys.readouterr().out


@pytest.mark.parametrize("spelling", [["--workload", "w3"], ["--workload=w3"]])
def test_offline_w3_is_the_lora_benchmark(
    spelling: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """W3 needs adapters: `offline --workload w3` runs `lora`, without the --workload option."""
    with pytest.raises(SystemExit) as exit_:
        main(["offline", *spelling, "--num-prompts", "4", "--help"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith("usage: loragate-bench lora")
    assert _without_option([*spelling, "--num-prompts", "4"], "--workload") == [
        "--num-prompts",
        "4",
    ]


def test_an_unknown_benchmark_is_refused_with_the_listing() -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["nonesuch"])
    assert "no benchmark 'nonesuch'" in str(exit_.value.code)


def test_the_product_never_imports_bench() -> None:
    """The gateway's CLI, app and server start-up load without a single bench module."""
    code = (
        "import sys\n"
        "import gateway.cli, gateway.app, gateway.cli.launch, gateway.openai.serving\n"
        "import gateway.cli.admin, gateway.cli.serve_flags\n"
        "gateway.cli.app.registered_commands\n"
        "loaded = [m for m in sys.modules if m == 'bench' or m.startswith('bench.')]\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_python_dash_m_bench_runs_the_same_entry_point() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "bench", "--help"], capture_output=True, text=True, check=True
    ).stdout
    assert "loragate-bench NAME" in out and "quantization" in out
