"""Fair scheduling across tenants: one tenant floods the engine; two tenants share it by weight.

    loragate-bench fairness [--model models/demo] [--duration 30] [--ratio 10] [--load 1.5]
        [--rate-b REQ_PER_S] [--weights 2:1] [--prompt-len 64] [--output-len 32]
        [--prompt-len-b N] [--output-len-b N] [--max-num-seqs 8] [--fair-delay-ratio 0.5]
        [--drain 60] [--rounds 2] [--seed 0] [--threads N]

Everything runs in this process, through the in-process AsyncEngine (no HTTP), with fairness
keys as the gateway passes them. Requests are greedy, ignore_eos, exactly `--output-len` new
tokens, prompts of `--prompt-len` random token ids (no prefix-cache hits); in the flood
phases B's requests may be of another shape (`--prompt-len-b`, `--output-len-b`: a chat
tenant beside a batch of long documents). Phases, each `--duration` seconds, in one run:

1. saturated: tenants A and B, weights `--weights` (2:1), each keeping `--backlog` requests
   in flight (always backlogged), policy fair. Each tenant's share of the tokens generated
   after the first fifth of the phase; goal: the weights' ratio within 10 %. The requests
   the engine finished per second here are its capacity.
2. B alone: B's requests arrive at B's rate (Poisson); its TTFT with nobody else.
3. A alone, fcfs and fair in turns (`--rounds`, the order swapped each round): A's flood
   without B; the output tokens per second of each policy, medians (one tenant: goal fair
   >= 0.97x fcfs).
4. flood, fcfs: A at `--ratio` times B's rate, plus B; policy fcfs.
5. flood, fair: the same arrivals' rates, policy fair (VTC, and short steps while B is
   present: engine/scheduler.py). Goal: B's TTFT p95 at most 1.5x its p95 alone.

B's rate is `--rate-b`, or else capacity x `--load` / (ratio + 1): A and B together offer
`--load` times what the engine serves, so A's queue grows for the whole phase. When a flood
phase's arrivals stop, B's requests still waiting get up to `--drain` seconds for their
first token (under fcfs they wait behind A's queue); then everything left is cancelled, and
a B request that never got its first token counts as unserved (not in the percentiles).
TTFT is from the call to generate() to the first token's update on the event loop; output
tok/s counts the tokens generated while the arrivals last. Between phases the bench waits
for the last phase's tenants to leave the engine's view (engine/fairness.py, LINGER).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from bench.workloads import allowed_token_ids, new_progress
from engine import EngineConfig, LLMEngine, SamplingParams
from engine.fairness import LINGER
from engine.frontend.async_engine import AsyncEngine
from engine.messages import EngineRequest

SHARE_TOLERANCE = 0.10  # the weighted share's goal: the weights' ratio within 10 %
TTFT_GOAL = 1.5  # B's TTFT p95 beside A under fair / alone, at most
THROUGHPUT_GOAL = 0.97  # A's flood alone: fair's output tok/s / fcfs's, at least
WARMUP_FRACTION = 0.2  # of the saturated phase, before the shares are counted


@dataclass(slots=True)
class Record:
    ttft: float | None = None
    num_tokens: int = 0


@dataclass(slots=True)
class Tenant:
    name: str  # A or B
    key: str  # its fairness key in this phase
    weight: float
    prompt_len: int
    output_len: int
    records: list[Record] = field(default_factory=list)
    num_tokens: int = 0  # generated so far, every request together


class Workload:
    """Prompts and sampling parameters; each request gets fresh random tokens."""

    def __init__(self, core: LLMEngine, seed: int) -> None:
        special = core.tokenizer.all_special_ids
        self.ids = allowed_token_ids(core.vocab_size, special)
        self.rng = np.random.default_rng(seed)
        self.next_id = 0

    def prompt(self, length: int) -> list[int]:
        return self.rng.choice(self.ids, size=length).tolist()

    @staticmethod
    def params(output_len: int) -> SamplingParams:
        return SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)

    def request_id(self, tenant: Tenant) -> str:
        self.next_id += 1
        return f"{tenant.key}-{self.next_id}"


async def one_request(client: AsyncEngine, workload: Workload, tenant: Tenant) -> None:
    record = Record()
    tenant.records.append(record)
    start = time.perf_counter()
    request = EngineRequest(
        workload.request_id(tenant),
        workload.prompt(tenant.prompt_len),
        workload.params(tenant.output_len),
        fairness_key=tenant.key,
        fairness_weight=tenant.weight,
    )
    async for update in client.generate(request):
        if update.new_token_ids:
            if record.ttft is None:
                record.ttft = time.perf_counter() - start
            record.num_tokens += len(update.new_token_ids)
            tenant.num_tokens += len(update.new_token_ids)


async def poisson_arrivals(
    client: AsyncEngine,
    workload: Workload,
    tenant: Tenant,
    rate: float,
    duration: float,
    rng: np.random.Generator,
    tasks: list[asyncio.Task[None]],
) -> None:
    loop = asyncio.get_running_loop()
    at = loop.time()
    end = at + duration
    while True:
        at += rng.exponential(1.0 / rate)
        if at >= end:
            return
        await asyncio.sleep(max(0.0, at - loop.time()))
        tasks.append(asyncio.create_task(one_request(client, workload, tenant)))


async def keep_backlogged(
    client: AsyncEngine, workload: Workload, tenant: Tenant, stop: asyncio.Event
) -> None:
    while not stop.is_set():
        await one_request(client, workload, tenant)


async def ticking(
    progress: Progress, task: Any, seconds: float, label: Callable[[], str], offset: float = 0.0
) -> None:
    """Advance a phase's bar from `offset` once a quarter second for `seconds`; `label()`
    describes it."""
    start = time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        progress.update(task, completed=offset + elapsed, description=label())
        await asyncio.sleep(0.25)
    progress.update(task, completed=offset + seconds, description=label())


async def cancel_all(tasks: list[asyncio.Task[None]]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def saturated(
    core: LLMEngine,
    workload: Workload,
    tenants: list[Tenant],
    backlog: int,
    duration: float,
    progress: Progress,
) -> dict[str, Any]:
    """Every tenant always backlogged: tokens generated per tenant after the warm-up."""
    client = AsyncEngine(core, max_waiting=1 << 20)
    client.start()
    stop = asyncio.Event()
    workers = [
        asyncio.create_task(keep_backlogged(client, workload, tenant, stop))
        for tenant in tenants
        for _ in range(backlog)
    ]
    bar = progress.add_task("saturated", total=duration)

    def label() -> str:
        return "saturated: " + " ".join(f"{t.name} {t.num_tokens} tok" for t in tenants)

    warmup = duration * WARMUP_FRACTION
    await ticking(progress, bar, warmup, label)
    tokens0 = {t.name: t.num_tokens for t in tenants}
    done0 = sum(r.num_tokens == t.output_len for t in tenants for r in t.records)
    await ticking(progress, bar, duration - warmup, label, offset=warmup)
    window = duration - warmup
    tokens = {t.name: t.num_tokens - tokens0[t.name] for t in tenants}
    done = sum(r.num_tokens == t.output_len for t in tenants for r in t.records)
    stop.set()
    await cancel_all(workers)
    await client.shutdown(0)
    return {"tokens": tokens, "capacity_rps": (done - done0) / window}


async def flood(
    core: LLMEngine,
    workload: Workload,
    tenants: list[tuple[Tenant, float]],
    duration: float,
    drain: float,
    seed: int,
    progress: Progress,
    label: str,
) -> float:
    """Poisson arrivals per (tenant, rate) for `duration`; then up to `drain` seconds for the
    last tenant's requests to get their first token; then cancel what is left. Returns the
    output tokens per second generated while the arrivals lasted."""
    client = AsyncEngine(core, max_waiting=1 << 20)
    client.start()
    tasks: list[asyncio.Task[None]] = []
    arrivals = [
        asyncio.create_task(
            poisson_arrivals(
                client, workload, tenant, rate, duration, np.random.default_rng([seed, i]), tasks
            )
        )
        for i, (tenant, rate) in enumerate(tenants)
    ]
    bar = progress.add_task(label, total=duration)

    def describe() -> str:
        parts = [
            f"{t.name} {sum(r.ttft is not None for r in t.records)}/{len(t.records)}"
            for t, _ in tenants
        ]
        return f"{label}: " + " ".join(parts) + " started"

    await ticking(progress, bar, duration, describe)
    await asyncio.gather(*arrivals)
    tok_per_s = sum(t.num_tokens for t, _ in tenants) / duration
    watched = tenants[-1][0]
    drain_bar = progress.add_task(f"{label}: drain", total=drain)
    start = time.perf_counter()
    while any(r.ttft is None for r in watched.records):
        elapsed = time.perf_counter() - start
        if elapsed >= drain:
            break
        progress.update(drain_bar, completed=elapsed, description=describe())
        await asyncio.sleep(0.1)
    progress.update(drain_bar, completed=drain)
    await cancel_all(tasks)
    await client.shutdown(0)
    await asyncio.sleep(LINGER)  # this phase's tenants leave the scheduler's view
    return tok_per_s


def ttft_row(tenant: Tenant) -> tuple[str, str, str, str]:
    ttfts = [r.ttft for r in tenant.records if r.ttft is not None]
    unserved = len(tenant.records) - len(ttfts)
    if not ttfts:
        return str(len(tenant.records)), "-", "-", str(unserved)
    p50, p95 = np.percentile(ttfts, [50, 95])
    return str(len(tenant.records)), f"{p50:.3f}", f"{p95:.3f}", str(unserved)


@dataclass(slots=True)
class Phase:
    name: str
    policy: str
    tenants: list[tuple[Tenant, float]]  # (tenant, its request rate)
    tok_per_s: float = 0.0


def p95(tenant: Tenant) -> float | None:
    ttfts = [r.ttft for r in tenant.records if r.ttft is not None]
    return float(np.percentile(ttfts, 95)) if ttfts else None


def results_table(
    phases: list[Phase], share: dict[str, Any], weights: tuple[float, float], title: str
) -> Table:
    table = Table(title=title)
    for name in ("phase", "policy", "tenant", "req/s", "requests", "TTFT p50 s", "TTFT p95 s"):
        table.add_column(name, justify="left" if name in ("phase", "policy") else "right")
    table.add_column("unserved", justify="right")
    table.add_column("output tok/s", justify="right")
    table.add_column("token share", justify="right")
    for phase in phases:
        for i, (tenant, rate) in enumerate(phase.tenants):
            throughput = f"{phase.tok_per_s:.0f}" if i == 0 else ""
            row = (phase.name, phase.policy, tenant.name, f"{rate:.2f}", *ttft_row(tenant))
            table.add_row(*row, throughput, "")
    total = sum(share["tokens"].values())
    for tenant in share["tenants"]:
        tokens = share["tokens"][tenant.name]
        percent = f"{100 * tokens / total:.1f} %" if total else "-"
        table.add_row(
            f"saturated {weights[0]:g}:{weights[1]:g}",
            "fair",
            f"{tenant.name} (w {tenant.weight:g})",
            "-",
            *ttft_row(tenant)[:3],
            "-",
            "",
            f"{percent} ({tokens} tok)",
        )
    return table


def share_verdict(share: dict[str, Any], weights: tuple[float, float]) -> str:
    a, b = share["tokens"]["A"], share["tokens"]["B"]
    goal = weights[0] / weights[1]
    if b == 0:
        return "B generated nothing in the window: no ratio"
    ratio = a / b
    ok = abs(ratio / goal - 1) <= SHARE_TOLERANCE
    return (
        f"saturated: A/B generated tokens {ratio:.2f}, goal {goal:.2f} within "
        f"{SHARE_TOLERANCE:.0%}: {'met' if ok else 'MISSED'}"
    )


def ttft_verdict(alone: Tenant, fcfs: Tenant, fair: Tenant) -> str:
    base, queued, shared = p95(alone), p95(fcfs), p95(fair)
    if base is None or shared is None:
        return "B's TTFT: B was not served, no ratio"
    beside = "-" if queued is None else f"{queued:.3f} s"
    ratio = shared / base
    return (
        f"B's TTFT p95: alone {base:.3f} s, beside A fcfs {beside}, fair {shared:.3f} s = "
        f"{ratio:.2f}x alone, goal at most {TTFT_GOAL:g}x: "
        f"{'met' if ratio <= TTFT_GOAL else 'MISSED'}"
    )


def throughput_verdict(a_alone: list[Phase], fcfs: Phase, fair: Phase) -> str:
    """A's flood alone: the median of each policy's rounds."""
    by_policy = {
        policy: float(np.median([p.tok_per_s for p in a_alone if p.policy == policy]))
        for policy in ("fcfs", "fair")
    }
    if by_policy["fcfs"] <= 0 or fcfs.tok_per_s <= 0:
        return "output tok/s: nothing generated, no ratio"
    ratio = by_policy["fair"] / by_policy["fcfs"]
    return (
        f"output tok/s, fair / fcfs: A's flood alone {ratio:.2f}x (medians of "
        f"{len(a_alone) // 2} rounds), goal at least "
        f"{THROUGHPUT_GOAL:g}x: {'met' if ratio >= THROUGHPUT_GOAL else 'MISSED'}; A and B "
        f"{fair.tok_per_s / fcfs.tok_per_s:.2f}x (B's steps kept short cost A this)"
    )


def build(args: argparse.Namespace, policy: str) -> LLMEngine:
    longest = max(args.prompt_len + args.output_len, args.prompt_len_b + args.output_len_b)
    return LLMEngine(
        EngineConfig(
            model=args.model,
            scheduling_policy=policy,
            fair_delay_ratio=args.fair_delay_ratio,
            max_model_len=longest + 1,
            max_num_seqs=args.max_num_seqs,
            kv_cache_memory=args.kv_cache_memory,
            num_threads=args.threads,
        )
    )


def warm_up(core: LLMEngine, workload: Workload, prompt_len: int) -> None:
    """Compile and fault in the step's paths (prefill and decode) before anything is timed."""
    for i in range(2):
        core.add_request(f"warmup-{i}", workload.prompt(prompt_len), workload.params(4))
    while core.has_unfinished_requests():
        core.step()


async def run(args: argparse.Namespace, console: Console) -> None:
    weights = _parse_weights(args.weights)
    with new_progress(console) as progress:
        load = progress.add_task("load fair and fcfs engines", total=2)
        fair = build(args, "fair")
        progress.advance(load)
        fcfs = build(args, "fcfs")
        progress.advance(load)
        workload = Workload(fair, args.seed)
        for core in (fair, fcfs):
            warm_up(core, workload, args.prompt_len)

        a_shape = (args.prompt_len, args.output_len)
        b_shape = (args.prompt_len_b, args.output_len_b)
        sat = [
            Tenant("A", "saturated-A", weights[0], *a_shape),
            Tenant("B", "saturated-B", weights[1], *a_shape),
        ]
        share = await saturated(fair, workload, sat, args.backlog, args.duration, progress)
        share["tenants"] = sat
        capacity = share["capacity_rps"]
        rate_b = args.rate_b or capacity * args.load / (args.ratio + 1)
        if rate_b <= 0:
            raise SystemExit("the saturated phase finished no request: raise --duration")
        rate_a = rate_b * args.ratio

        async def phase(name: str, policy: str, tenants: list[tuple[Tenant, float]]) -> Phase:
            core = fair if policy == "fair" else fcfs
            label = f"{name} {policy}" if policy != "-" else name
            result = Phase(name, policy, tenants)
            # A's flood alone is timed while it arrives; its queue's first tokens are not.
            drain = 0.0 if name == "A alone" else args.drain
            result.tok_per_s = await flood(
                core, workload, tenants, args.duration, drain, args.seed, progress, label
            )
            return result

        flood_name = f"A {args.ratio:g}x + B"
        b_alone = await phase("B alone", "-", [(Tenant("B", "alone-B", 1.0, *b_shape), rate_b)])
        # The policies take turns, the order swapped each round: drift in the machine's
        # speed falls on both.
        a_alone = [
            await phase(
                "A alone", policy, [(Tenant("A", f"alone-{policy}-{r}", 1.0, *a_shape), rate_a)]
            )
            for r in range(args.rounds)
            for policy in (("fcfs", "fair") if r % 2 == 0 else ("fair", "fcfs"))
        ]
        floods = [
            await phase(
                flood_name,
                policy,
                [
                    (Tenant("A", f"{policy}-A", 1.0, *a_shape), rate_a),
                    (Tenant("B", f"{policy}-B", 1.0, *b_shape), rate_b),
                ],
            )
            for policy in ("fcfs", "fair")
        ]

    b_prompt = "" if b_shape == a_shape else f", B {args.prompt_len_b}+{args.output_len_b}"
    title = (
        f"fair scheduling ({Path(args.model).name}, {args.prompt_len}+{args.output_len} tokens"
        f"{b_prompt}, max_num_seqs {args.max_num_seqs}, {args.duration:g} s phases; capacity "
        f"{capacity:.2f} req/s, flood offers {(rate_a + rate_b) / capacity:.2f}x it)"
    )
    console.print(results_table([b_alone, *a_alone, *floods], share, weights, title))
    console.print(share_verdict(share, weights))
    alone = b_alone.tenants[0][0]
    console.print(ttft_verdict(alone, floods[0].tenants[1][0], floods[1].tenants[1][0]))
    console.print(throughput_verdict(a_alone, *floods))


def _parse_weights(spec: str) -> tuple[float, float]:
    try:
        a, b = (float(w) for w in spec.split(":"))
    except ValueError:
        raise SystemExit(f"--weights takes A:B, like 2:1, got {spec!r}") from None
    if a <= 0 or b <= 0:
        raise SystemExit("--weights must be positive")
    return a, b


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="loragate-bench fairness",
        description="A tenant flooding at 10x another's rate (B's TTFT: alone, fcfs, fair), "
        "and a 2:1 weighted share under saturation, in one run.",
    )
    p.add_argument("--model", default="models/demo", help="checkpoint (`loragate demo-model`)")
    p.add_argument("--duration", type=float, default=30.0, help="seconds per phase")
    p.add_argument("--ratio", type=float, default=10.0, help="A's request rate / B's")
    p.add_argument(
        "--rate-b", type=float, default=None, help="B's requests/s (default: from --load)"
    )
    p.add_argument(
        "--load", type=float, default=1.5, help="offered load / capacity, without --rate-b"
    )
    p.add_argument("--weights", default="2:1", help="A:B weights of the saturated phase")
    p.add_argument(
        "--backlog",
        type=int,
        default=None,
        help="saturated: requests in flight per tenant (default: 2 x max-num-seqs)",
    )
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument(
        "--prompt-len-b", type=int, default=None, help="B's prompts (default: --prompt-len)"
    )
    p.add_argument(
        "--output-len-b", type=int, default=None, help="B's outputs (default: --output-len)"
    )
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument(
        "--fair-delay-ratio", type=float, default=0.5, help="the engine's (docs/engine.md)"
    )
    p.add_argument("--kv-cache-memory", type=int, default=256 << 20, help="bytes")
    p.add_argument("--drain", type=float, default=60.0, help="seconds B's last requests get")
    p.add_argument(
        "--rounds", type=int, default=2, help="rounds of A's flood alone under each policy"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    return p


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    if not Path(args.model).is_dir():
        raise SystemExit(f"no model at {args.model}: build one with `loragate demo-model`")
    if args.backlog is None:
        args.backlog = 2 * args.max_num_seqs
    args.prompt_len_b = args.prompt_len_b or args.prompt_len
    args.output_len_b = args.output_len_b or args.output_len
    console = Console() if Console().is_terminal else Console(width=150)
    asyncio.run(run(args, console))


if __name__ == "__main__":
    main()
