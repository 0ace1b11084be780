"""Time to register an adapter through the admin REST: a multipart upload of its two files,
validated against the base model and stored, as a client sees it (request to 201).

Uploads the same adapter `--repeat` times under new names (the first stores the files, the
rest find them stored but validate them all the same), prints the times, and deletes the
adapters again.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import uuid
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from adapters.peft import CONFIG_FILE, WEIGHTS_FILE


def upload_times(base_url: str, token: str, adapter: Path, repeat: int) -> list[float]:
    files = {name: (adapter / name).read_bytes() for name in (CONFIG_FILE, WEIGHTS_FILE)}
    times, ids = [], []
    headers = {"Authorization": f"Bearer {token}"}
    with httpx.Client(base_url=base_url, headers=headers, timeout=600) as client:
        for _ in range(repeat):
            name = f"bench-{uuid.uuid4().hex[:8]}"
            start = time.perf_counter()
            resp = client.post(
                "/admin/adapters",
                data={"name": name},
                files={n: (n, data, "application/octet-stream") for n, data in files.items()},
            )
            times.append(time.perf_counter() - start)
            resp.raise_for_status()
            ids.append(resp.json()["id"])
        for adapter_id in ids:
            client.delete(f"/admin/adapters/{adapter_id}")
    return times


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="loragate-bench upload", description=__doc__.split("\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--adapter", type=Path, required=True, help="a PEFT adapter directory")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument(
        "--admin-token",
        default=os.environ.get("LORAGATE_ADMIN_TOKEN"),
        help="default: $LORAGATE_ADMIN_TOKEN (loragate admin token)",
    )
    args = p.parse_args(argv)
    if not args.admin_token:
        p.error("an admin token is needed: --admin-token or $LORAGATE_ADMIN_TOKEN")
    times = upload_times(args.base_url, args.admin_token, args.adapter, args.repeat)
    size = sum((args.adapter / n).stat().st_size for n in (CONFIG_FILE, WEIGHTS_FILE))
    table = Table(title=f"adapter upload, {args.adapter.name} ({size / 2**20:.1f} MiB)")
    for column in ("uploads", "first ms", "median ms", "min ms", "max ms"):
        table.add_column(column, justify="right")
    table.add_row(
        str(len(times)),
        f"{times[0] * 1e3:.0f}",
        f"{statistics.median(times) * 1e3:.0f}",
        f"{min(times) * 1e3:.0f}",
        f"{max(times) * 1e3:.0f}",
    )
    Console().print(table)
