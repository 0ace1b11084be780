"""Our engine's side of the offline benchmark (bench/hf_baseline.py is Hugging Face's): build an
engine for a run, warm it up, time workloads through it (the fastest of `repeat`), and profile
its steps."""

from __future__ import annotations

import cProfile
import gc
import io
import pstats
import time
from typing import Any

from rich.progress import Progress

from bench.workloads import Workload, best_of


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def build_ours(
    model_dir: str,
    *,
    prefix_caching: bool,
    max_num_seqs: int,
    block_size: int,
    num_kv_blocks: int | None,
    kv_cache_memory: int | None,
    progress: Progress,
    label: str,
    dtype: str = "float32",
) -> Any:
    from engine.frontend.offline import LLM

    task = progress.add_task(f"load {label}", total=None)

    def on_tensor(done: int, total: int) -> None:
        progress.update(task, completed=done, total=total)

    kwargs: dict[str, Any] = dict(
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        enable_prefix_caching=prefix_caching,
        dtype=dtype,
    )
    if kv_cache_memory is not None:
        kwargs["kv_cache_memory"] = kv_cache_memory
    else:
        kwargs["num_kv_blocks"] = num_kv_blocks
    llm = LLM(model=model_dir, progress=on_tensor, **kwargs)
    return llm


def warmup_ours(llm: Any, prompts: list[list[int]], output_len: int) -> None:
    from engine.request import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts, params)
    llm.engine.kv.reset_prefix_cache()


def run_ours(
    llm: Any,
    workload: Workload,
    output_len: int,
    progress: Progress,
    label: str,
    repeat: int = 1,
) -> dict[str, Any]:
    """Time `llm.generate` over the workload; with repeat > 1 keep the fastest run."""
    return best_of(
        lambda lbl: _run_ours_once(llm, workload, output_len, progress, lbl), label, repeat
    )


def _run_ours_once(
    llm: Any, workload: Workload, output_len: int, progress: Progress, label: str
) -> dict[str, Any]:
    from engine.request import SamplingParams

    engine = llm.engine
    kv = engine.kv
    sched = engine.scheduler
    block_size = kv.block_size
    num_blocks = kv.pool.num_blocks
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    if not kv.reset_prefix_cache():
        raise RuntimeError("the engine still holds KV blocks before a timed run")
    hit0, query0, preempt0 = kv.num_hit_tokens, kv.num_queried_tokens, sched.num_preemptions

    task = progress.add_task(label, total=len(workload.prompts))
    # Sampled after every engine step (on_step runs after the step's finished requests
    # were freed): slots of allocated blocks vs tokens whose KV is written.
    # Cached-but-unreferenced blocks sit in the free queue and count as free.
    alloc = used = steps = 0
    last_finished = 0

    def on_step(num_finished: int) -> None:
        nonlocal alloc, used, steps, last_finished
        steps += 1
        alloc += (num_blocks - kv.num_free_blocks) * block_size
        used += sum(r.num_computed_tokens for r in sched.running)
        if num_finished != last_finished:
            last_finished = num_finished
            progress.update(task, completed=num_finished)

    gc.collect()
    t0 = time.perf_counter()
    outputs = llm.generate(workload.prompts, params, on_step=on_step)
    wall = time.perf_counter() - t0
    progress.update(task, completed=len(workload.prompts))

    token_ids = [o.outputs[0].token_ids for o in outputs]
    num_out = sum(len(t) for t in token_ids)
    queried = kv.num_queried_tokens - query0
    return {
        "wall_s": wall,
        "output_tokens": num_out,
        "cached_tokens": kv.num_hit_tokens - hit0,
        "tok_s": num_out / wall,
        "kv_alloc_tokens": alloc,
        "kv_used_tokens": used,
        "kv_alloc_used": alloc / used if used else None,
        "steps": steps,
        "ms_per_step": 1e3 * wall / steps if steps else None,
        "prefix_hit_rate": (kv.num_hit_tokens - hit0) / queried if queried else 0.0,
        "preemptions": sched.num_preemptions - preempt0,
        "token_ids": token_ids,
    }


def profile_ours(llm: Any, prompts: list[list[int]], output_len: int, top: int = 15) -> str:
    """cProfile over `engine.step()` calls only (not request setup); top entries by cumulative."""
    from engine.request import SamplingParams

    engine = llm.engine
    engine.kv.reset_prefix_cache()
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"profile-{i}", prompt, params)
    prof = cProfile.Profile()
    steps = 0
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        prof.enable()
        engine.step()
        prof.disable()
        steps += 1
    wall = time.perf_counter() - t0
    buf = io.StringIO()
    buf.write(f"{steps} steps, {wall:.2f} s under cProfile ({1e3 * wall / steps:.2f} ms/step)\n")
    pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(top)
    return buf.getvalue()


# -- the benchmark --------------------------------------------------------------------------
