"""loragate against vLLM-CPU in one run: the servers take turns (one up at a time, the order
swapped every round), each round drives every workload at both with `bench serve` (the
client pinned to one core), and the table gives each side's runs, their medians and the
ratio of medians.

    loragate-bench vs-vllm --model models/smollm2 [--dtype auto] [--workloads w1,w2]
        [--rounds 2] [--num-prompts 64] [--vllm-venv /tmp/peers/vllm-venv]

vLLM comes from `../shared/peers/` (setup_vllm.sh installs it, serve_vllm.sh serves a
directory); ours is `loragate serve --no-auth` at its defaults. `--against-tree DIR` puts
loragate from another checkout (an older commit's worktree) in vLLM's place: a change measured
against the tree before it, the same way. `--dtype` goes to both
servers, `auto` resolved once as the processor the run is held to resolves it (bfloat16
where it has native bf16, as both servers pick for their users; float32 otherwise).
`--cpu-isa avx2` runs both as on an AVX2-only processor:
ours with `--cpu-isa avx2`, vLLM with torch, oneDNN and MKL held to AVX2 and its AVX2 build
(`_C_AVX2`, which it loads where torch reports no AVX-512). Every run uses its own prompt
seed, so no run finds its prompts in a prefix cache; both servers of a round get the same
seed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from bench.servers import stop, wait_ready
from kernels import cpu_features

PEERS = Path(__file__).resolve().parents[1].parent / "shared" / "peers"


def _start(side: str, args: argparse.Namespace, name: str, log: Path) -> subprocess.Popen[bytes]:
    env = os.environ | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    if side == "loragate" or args.against_tree is not None:
        if side != "loragate":  # the other tree's modules ahead of this venv's editable install
            env |= {"PYTHONPATH": str(args.against_tree)}
        workdir = Path(tempfile.mkdtemp(prefix="vs-vllm-"))
        cmd = [
            str(Path(sys.executable).parent / "loragate"), "serve",
            "--model", str(Path(args.model).resolve()), "--served-model-name", name,
            "--port", str(args.port), "--no-auth", "--dtype", args.peak_dtype,
            "--database-url", f"sqlite+aiosqlite:///{workdir}/db.sqlite",
            "--adapter-store", str(workdir / "adapters"),
            *(args.loragate_args if side == "loragate" else args.against_args).split(),
        ]  # fmt: skip
        if args.cpu_isa != "native":
            cmd += ["--cpu-isa", args.cpu_isa]
    else:
        env |= {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "VLLM_CPU_KVCACHE_SPACE": "2"}
        if args.cpu_isa == "avx2":
            env |= _vllm_held_to_avx2(env)
        cmd = [
            f"{args.vllm_venv}/bin/python", "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(Path(args.model).resolve()), "--served-model-name", name,
            "--host", "127.0.0.1", "--port", str(args.port), "--max-model-len", "2048",
            "--dtype", args.peak_dtype,
        ]  # fmt: skip
    out = log.open("wb")
    cwd = args.against_tree if side != "loragate" else None
    return subprocess.Popen(
        cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True
    )


# Where torch would report AVX-512, vLLM reports none in every process it starts: it then loads
# its AVX2 build, as on a processor without AVX-512.
_VLLM_AVX2_SITECUSTOMIZE = """
import torch
torch.cpu._is_avx512_supported = lambda: False
torch.cpu._is_avx512_bf16_supported = lambda: False
"""


def _vllm_held_to_avx2(env: dict[str, str]) -> dict[str, str]:
    site = Path(tempfile.mkdtemp(prefix="vllm-avx2-"))
    (site / "sitecustomize.py").write_text(_VLLM_AVX2_SITECUSTOMIZE)
    path = os.pathsep.join(p for p in (str(site), env.get("PYTHONPATH", "")) if p)
    return {
        "PYTHONPATH": path,
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    }


def _bench(
    args: argparse.Namespace, side: str, name: str, workload: str, seed: int
) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "bench.serve",
                "--base-url",
                f"http://127.0.0.1:{args.port}",
                "--model",
                name,
                "--workload",
                workload,
                *(["--num-prompts", str(args.num_prompts)] if args.num_prompts else []),
                "--seed",
                str(seed),
                "--cpu",
                "1",
                "--label",
                side,
                "--json",
                out.name,
                "--model-dir",
                args.model,
                "--dtype",
                args.peak_dtype,
            ],  # fmt: skip
            check=True,
            stdout=subprocess.DEVNULL,
        )
        return json.loads(Path(out.name).read_text())


def run(args: argparse.Namespace, console: Console) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """rows[workload][side]: one summary row per round."""
    name = Path(args.model).name
    rows: dict[str, dict[str, list[dict[str, Any]]]] = {
        w: {"loragate": [], "vllm": []} for w in args.workloads
    }
    logs = Path(tempfile.mkdtemp(prefix="vs-vllm-logs-"))
    for round_ in range(args.rounds):
        order = ["loragate", "vllm"] if round_ % 2 == 0 else ["vllm", "loragate"]
        for side in order:
            log = logs / f"{side}-{round_}.log"
            console.print(f"round {round_ + 1}/{args.rounds}: starting {side} (log {log})")
            proc = _start(side, args, name, log)
            try:
                wait_ready(f"http://127.0.0.1:{args.port}", proc, log)
                for i, workload in enumerate(args.workloads):
                    row = _bench(args, side, name, workload, seed=1000 * (round_ + 1) + i)
                    rows[workload][side].append(row)
                    console.print(
                        f"  {side} {workload}: {row['output_tok_s']:.0f} tok/s, "
                        f"TTFT p50 {row['ttft_p50_s'] * 1e3:.0f} ms, "
                        f"ITL p50 {row['itl_p50_s'] * 1e3:.1f} ms, failed {row['failed']}"
                    )
            finally:
                stop(proc)
    return rows


def table(rows: dict[str, dict[str, list[dict[str, Any]]]], dtype: str, other: str) -> Table:
    t = Table(title=f"loragate vs {other}, {dtype}: runs (median)")
    for col in ("workload", "loragate tok/s", f"{other} tok/s", "ratio", f"TTFT p50 ours / {other}",
                f"ITL p50 ours / {other}", f"MFU ours / {other}"):  # fmt: skip
        t.add_column(col, justify="right")

    def med(side_rows: list[dict[str, Any]], key: str) -> float:
        return statistics.median(r[key] for r in side_rows) if side_rows else float("nan")

    for workload, sides in rows.items():
        ours, theirs = sides["loragate"], sides["vllm"]
        runs = {s: " ".join(f"{r['output_tok_s']:.0f}" for r in sides[s]) for s in sides}
        t.add_row(
            workload,
            f"{runs['loragate']} ({med(ours, 'output_tok_s'):.0f})",
            f"{runs['vllm']} ({med(theirs, 'output_tok_s'):.0f})",
            f"{med(ours, 'output_tok_s') / med(theirs, 'output_tok_s'):.2f}x",
            f"{med(ours, 'ttft_p50_s') * 1e3:.0f} / {med(theirs, 'ttft_p50_s') * 1e3:.0f} ms",
            f"{med(ours, 'itl_p50_s') * 1e3:.1f} / {med(theirs, 'itl_p50_s') * 1e3:.1f} ms",
            f"{med(ours, 'mfu'):.0%} / {med(theirs, 'mfu'):.0%}",
        )
    return t


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="loragate-bench vs-vllm", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="a Hugging Face model directory")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--workloads", default="w1,w2", help="comma-separated: w1, w2, wv, wlong")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=None, help="default: per workload")
    p.add_argument("--port", type=int, default=18080)
    p.add_argument("--vllm-venv", default="/tmp/peers/vllm-venv")
    p.add_argument(
        "--loragate-args",
        default="",
        help="more `loragate serve` flags, e.g. '--quantization int8' (vLLM runs as it is)",
    )
    p.add_argument(
        "--against-tree",
        type=Path,
        default=None,
        help="loragate from this checkout in vLLM's place (e.g. a worktree of the commit before)",
    )
    p.add_argument(
        "--against-args",
        default="",
        help="`loragate serve` flags for the other tree's side (e.g. the same tree with "
        "--loragate-args '--cpu-isa avx2' against none)",
    )
    p.add_argument(
        "--cpu-isa",
        default="native",
        choices=list(cpu_features.ISAS),
        help="avx2: both servers as on an AVX2-only processor (issue 43)",
    )
    p.add_argument("--json", type=Path, default=None, help="write every row here")
    args = p.parse_args(argv)
    args.workloads = [w for w in args.workloads.split(",") if w]
    if args.against_tree is not None:
        args.against_tree = args.against_tree.resolve()
    elif not Path(args.vllm_venv, "bin", "python").exists():
        p.error(f"no vLLM at {args.vllm_venv}: run {PEERS / 'setup_vllm.sh'} first")
    cpu_features.use_isa(args.cpu_isa)  # the header's flags and dtype, and both servers'
    bf16 = cpu_features.native_bf16()
    # `auto` resolved here, as on the processor the run is held to, and given to both servers:
    # vLLM's own `auto` looks past --cpu-isa avx2 and picks bfloat16 on an AVX-512 BF16 CPU,
    # which it then runs emulated on AVX2 (3x slower than float32).
    args.peak_dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if bf16 else "float32")
    console = Console(width=max(Console().width, 130))
    console.print(f"{Path(args.model).name}, --dtype {args.dtype} ({args.peak_dtype} here) "
                  f"{args.loragate_args}; {cpu_features.describe()}")  # fmt: skip
    rows = run(args, console)
    other = f"loragate at {args.against_tree}" if args.against_tree else "vLLM-CPU"
    console.print(table(rows, args.peak_dtype, other))
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
