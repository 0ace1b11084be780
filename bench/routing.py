"""Routing across replicas: affinity (adapter, then prefix, under a load bound) against
round-robin, with one engine alone as the hit-rate reference, in one run.

    loragate-bench routing --model models/demo [--tenants 8] [--adapters-per-tenant 4]
        [--system-tokens 512] [--num-prompts 512] [--concurrency 16] [--output-len 16]
        [--rounds 3] [--kv-cache-memory 512MiB]

Every round runs each setup (each first in turn), starting it fresh (empty caches): `loragate
engine` replicas of the model sharing one adapter store (one core each, as if each were a
machine), and a gateway whose models file lists them (`--routing` as the setup says).
Through the admin REST it makes the tenants, each with its own API key and its own adapters
(same names, different weights: tenant-scoped), then streams /v1/completions: each request a
random tenant and one of its adapters, the tenant's own system prompt (token ids) and a random
question. The engines' own counters give the prefix-cache hit rate (prompt tokens found cached
over prompt tokens looked up, every replica summed).

  single       one engine                          (what one engine's cache reaches)
  round_robin  two engines, requests in turn
  affinity     two engines, gateway.models.routing
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from rich.console import Console
from rich.table import Table

from bench.serve import RequestResult, one_request, summarize
from bench.servers import LORAGATE_CLI, spawn, stop, wait_ready
from kernels import cpu_features

SETUPS = (("single", 1, "affinity"), ("round_robin", 2, "round_robin"), ("affinity", 2, "affinity"))
SECRET = "a-benchmark-secret-that-is-long-enough-for-loragate-0123456789"


def build_adapters(model: Path, root: Path, count: int) -> list[Path]:
    from adapters.demo import build_demo_adapter

    paths = []
    for i in range(count):
        path = root / f"a{i}"
        if not (path / "adapter_model.safetensors").exists():
            build_demo_adapter(model, path, rank=8, targets="attention", seed=100 + i)
        paths.append(path)
    return paths


def engine_counter(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    match = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def make_tenants(url: str, args: argparse.Namespace, adapters: list[Path]) -> list[str]:
    """Tenants with a key each and `adapters_per_tenant` adapters named a0, a1, ...; their keys."""
    from pydantic import SecretStr

    from gateway.settings import Settings
    from gateway.tenancy.admin_auth import mint_admin_token

    token = mint_admin_token(Settings(secret_key=SecretStr(SECRET)), 3600)
    keys = []
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}) as admin:
        for t in range(args.tenants):
            tenant = admin.post("/admin/tenants", json={"name": f"tenant-{t}"}).json()["id"]
            keys.append(admin.post(f"/admin/tenants/{tenant}/keys", json={}).json()["key"])
            for a in range(args.adapters_per_tenant):
                path = adapters[t * args.adapters_per_tenant + a]
                files = {
                    n: (n, (path / n).read_bytes(), "application/octet-stream")
                    for n in ("adapter_config.json", "adapter_model.safetensors")
                }
                made = admin.post(
                    "/admin/adapters", data={"name": f"a{a}", "tenant_id": tenant}, files=files
                )
                made.raise_for_status()
    return keys


async def drive(url: str, keys: list[str], args: argparse.Namespace) -> tuple[list[Any], float]:
    rng = np.random.default_rng(args.seed)
    systems = [rng.integers(100, 8000, size=args.system_tokens).tolist() for _ in keys]
    semaphore = asyncio.Semaphore(args.concurrency)
    clients = [
        httpx.AsyncClient(headers={"Authorization": f"Bearer {k}"}, timeout=600) for k in keys
    ]

    async def one(n: int) -> RequestResult:
        tenant = int(rng.integers(len(keys)))
        adapter = f"a{int(rng.integers(args.adapters_per_tenant))}"
        prompt = systems[tenant] + rng.integers(100, 8000, size=32).tolist()
        async with semaphore:
            return await one_request(
                clients[tenant], f"{url}/v1/completions", adapter, prompt, args.output_len
            )

    start = time.perf_counter()
    results = await asyncio.gather(*(one(n) for n in range(args.num_prompts)))
    elapsed = time.perf_counter() - start
    for client in clients:
        await client.aclose()
    return list(results), elapsed


def run_setup(
    name: str, replicas: int, policy: str, args: argparse.Namespace, adapters: list[Path]
) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix=f"routing-{name}-"))
    store = work / "adapters"
    engine_urls = [f"http://127.0.0.1:{args.port + 1 + i}" for i in range(replicas)]
    processes = []
    try:
        for i in range(replicas):
            # One core per replica, as if each were a machine of its own.
            command = [
                LORAGATE_CLI, "engine", "--model", args.model, "--port", str(args.port + 1 + i),
                "--adapter-store", str(store), "--kv-cache-memory", args.kv_cache_memory,
                "--num-threads", "1", "--prefill-threads", "1",
            ]  # fmt: skip
            processes.append(spawn(command, work / f"engine{i}.log"))
        for i, engine_url in enumerate(engine_urls):
            wait_ready(engine_url, processes[i], work / f"engine{i}.log", path="/health")
        models = work / "models.yaml"
        models.write_text(
            json.dumps({"models": [{"name": "demo", "path": args.model, "urls": engine_urls}]})
        )
        url = f"http://127.0.0.1:{args.port}"
        serve = [
            LORAGATE_CLI, "serve", "--models-config", str(models), "--port", str(args.port),
            "--routing", policy, "--secret-key", SECRET, "--no-demo-tenant",
            "--database-url", f"sqlite+aiosqlite:///{work}/db.sqlite",
            "--adapter-store", str(store),
        ]  # fmt: skip
        processes.append(spawn(serve, work / "serve.log"))
        wait_ready(url, processes[-1], work / "serve.log", path="/health")
        keys = make_tenants(url, args, adapters)
        results, elapsed = asyncio.run(drive(url, keys, args))
        hits = sum(engine_counter(u, "loragate:prefix_cache_hits_total") for u in engine_urls)
        queries = sum(engine_counter(u, "loragate:prefix_cache_queries_total") for u in engine_urls)
        loads = sum(engine_counter(u, "loragate:lora_loads_total") for u in engine_urls)
        return {
            "setup": name,
            "hit_rate": hits / max(queries, 1),
            "adapter_loads": loads,
        } | summarize(results, elapsed)
    finally:
        for process in reversed(processes):
            stop(process)


def report(runs: dict[str, list[dict[str, Any]]], console: Console) -> None:
    """Each setup's runs and medians; the ratios are of medians."""
    table = Table(title="routing across two `loragate engine` replicas (medians; runs)")
    for column in ("setup", "hit rate", "adapter loads", "output tok/s", "TTFT p50", "TTFT p95"):
        table.add_column(column, justify="right")
    medians: dict[str, dict[str, float]] = {}
    for name, rows in runs.items():
        median = {
            key: statistics.median(r[key] for r in rows)
            for key in ("hit_rate", "adapter_loads", "output_tok_s", "ttft_p50_s", "ttft_p95_s")
        }
        medians[name] = median
        each = " ".join(f"{r['output_tok_s']:.0f}" for r in rows)
        table.add_row(
            name,
            f"{median['hit_rate']:.1%}",
            f"{median['adapter_loads']:.0f}",
            f"{median['output_tok_s']:,.0f} ({each})",
            f"{median['ttft_p50_s'] * 1e3:.0f} ms",
            f"{median['ttft_p95_s'] * 1e3:.0f} ms",
        )
    console.print(table)
    affinity, rr, single = medians["affinity"], medians["round_robin"], medians["single"]
    hit_ratio = affinity["hit_rate"] / max(single["hit_rate"], 1e-9)
    speed_ratio = affinity["output_tok_s"] / rr["output_tok_s"]
    failed = sum(r["failed"] for rows in runs.values() for r in rows)
    console.print(
        f"affinity hit rate / one engine's: {hit_ratio:.3f}; "
        f"affinity / round-robin output tok/s: {speed_ratio:.3f}x; failed requests: {failed}"
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="loragate-bench routing", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="models/demo")
    p.add_argument("--tenants", type=int, default=8)
    p.add_argument("--adapters-per-tenant", type=int, default=4)
    p.add_argument("--system-tokens", type=int, default=512)
    p.add_argument("--num-prompts", type=int, default=512)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--kv-cache-memory",
        default="512MiB",
        help="each engine's KV pool: below the tenants' prefixes together, a replica holds "
        "only part of the working set (the case affinity is for)",
    )
    p.add_argument("--port", type=int, default=8040, help="the gateway's; engines' follow it")
    p.add_argument(
        "--adapter-dir", type=Path, default=Path(tempfile.gettempdir()) / "routing-adapters"
    )
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    console = Console()
    console.print(f"CPU: {cpu_features.describe()}")
    adapters = build_adapters(
        Path(args.model), args.adapter_dir, args.tenants * args.adapters_per_tenant
    )
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in SETUPS}
    for round_index in range(args.rounds):
        shift = round_index % len(SETUPS)  # each setup first in turn
        for name, replicas, policy in SETUPS[shift:] + SETUPS[:shift]:
            row = run_setup(name, replicas, policy, args, adapters)
            runs[name].append(row)
            console.print(
                f"round {round_index + 1} {name}: {row['output_tok_s']:,.0f} tok/s, "
                f"hit rate {row['hit_rate']:.1%}"
            )
    report(runs, console)
    if args.json is not None:
        args.json.write_text(json.dumps(runs, indent=2))


if __name__ == "__main__":
    main()
