"""`loragate serve`: its options are the Settings fields (one flag each, vLLM's names where vLLM
has one), so a knob is defined once; a flag left out falls to its `LORAGATE_*` variable, then
to its default. The help text below is all a field needs besides its type and default.
"""

from __future__ import annotations

import inspect
import types
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated, Any, get_args, get_origin

import typer
from pydantic import SecretStr, ValidationError

from gateway.settings import Settings
from kernels import cpu_features

HELP: dict[str, str] = {
    "model": "Hugging Face model directory.",
    "served_model_name": "The `model` clients send. Default: the directory's name.",
    "models_config": "A YAML file of base models to serve, each with its engine knobs "
    "(docs: Several models). Default: --model alone.",
    "max_pending_per_model": "Requests held for a model whose engine is starting (503 past).",
    "cold_start_timeout": "Seconds a request waits for its model's engine to start (503 past).",
    "zygote": "Fork engine processes from one process that has imported torch and the engine "
    "(milliseconds), rather than spawn each (seconds): cold starts, scale-up and restarts.",
    "spare_engines": "Engine processes kept started ahead, torch imported, for models that "
    "start on demand (0: none).",
    "spare_engine_memory": "Memory a spare faults in ahead, so that the model it becomes loads "
    "into pages already there: auto (what the largest such model writes at its start, up to "
    "1GiB), a size (512MiB) or 0.",
    "engine_token": "The token between gateways and `loragate engine`s: engines take tenant "
    "context only with it (a secret of 32 bytes or more). Default: none (engines on loopback).",
    "routing": "How a model's replicas share its requests: affinity (the replica holding the "
    "adapter, else the prompt's first block, under a load bound), least_loaded, round_robin, or "
    "picker (its one url is an inference gateway whose endpoint picker chooses an engine for "
    "each request).",
    "max_model_len": "Prompt + output tokens per sequence. Default: the model's.",
    "block_size": "Tokens per KV block.",
    "kv_cache_memory": "KV pool size (512MiB, 4GiB). Default: 2GiB on CPU, profiled on CUDA.",
    "memory_utilization": "CUDA memory fraction for weights and KV.",
    "max_num_seqs": "Sequences per step.",
    "max_num_batched_tokens": "Tokens per step (the chunked-prefill budget). Default: 2048, "
    "or 512 on a CPU without AVX-512 (shorter steps: an earlier first token there).",
    "enable_prefix_caching": "Reuse KV blocks of identical prefixes (same adapter and salt).",
    "enable_chunked_prefill": "Split long prompts across steps.",
    "max_waiting": "Queued requests before 503.",
    "scheduling_policy": "fair (priority bands, lower first; tenants share a band by weight, "
    "VTC), priority (bands, arrival order within them) or fcfs (arrival order; priority "
    "ignored).",
    "priority_max_wait": "Seconds a priority band with requests waiting may go without one "
    "admitted while better bands keep the engine busy; then its next request runs (bounded "
    "starvation).",
    "priority_step_yield": "A step holding a worse priority band's rows stops between layers "
    "for a better band's request sent while it runs, and resumes there after that request's "
    "prompt step: an interactive request's first token does not wait out a batch's step.",
    "batch_priority": "The priority band batch lines run in (lower runs first; interactive "
    "requests default to 0).",
    "fair_delay_ratio": "Policy fair, while a tenant below its share is active: other tenants' "
    "prompt chunks are cut so that a step takes about this times that tenant's own first step "
    "(its next first token waits at most that long for the step under way).",
    "dtype": "auto (CPU: bfloat16 with AVX-512 BF16 or AMX, else float32), float32, bfloat16, "
    "float16.",
    "speculative_config": 'n-gram speculative decoding, vLLM\'s JSON: {"method": "ngram", '
    '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}. Default: off.',
    "quantization": "int8: int8 weights and activations for the decoder's projections, "
    "smoothed (SmoothQuant) on a built-in calibration text at load. Default: none.",
    "device": "auto, cpu or cuda.",
    "seed": "The engine's generator for unseeded sampling.",
    "num_threads": "Torch threads for decode steps. Default: every core but one.",
    "prefill_threads": "Torch threads for prefills and the logits. Default: every core.",
    "engine_process": "Run the engine loop in its own process (no GIL shared with HTTP).",
    "restart_engine": "Restart an engine process that dies, with back-off.",
    "cpu_kernels": "C++ decode attention, RMSNorm, multi-LoRA and prepacked weights on CPU.",
    "cpu_isa": "The instruction set the process runs: native (all this CPU has), avx512 (the C++ "
    "kernels and oneDNN without AMX tiles) or avx2 (the C++ kernels, torch and oneDNN without "
    "AVX-512 or AMX, bfloat16 not native: how an AVX2-only processor runs, on any).",
    "weights_cache_dir": "Where each model's weights are written once as the engine runs them "
    "(converted, reordered for oneDNN) and mapped by every later start: auto "
    "(~/.cache/loragate/weights), a directory, or none.",
    "kernels": "Which kernels run: auto (triton on CUDA; C++ on the CPU, or torch with "
    "--no-cpu-kernels), triton (on the CPU only with TRITON_INTERPRET=1: tests), native, torch.",
    "enable_lora": "LoRA slots on the device.",
    "max_loras": "Adapters resident on the device.",
    "max_lora_rank": "The largest adapter rank accepted.",
    "max_cpu_loras": "Adapters kept in CPU memory beyond the resident ones.",
    "lora_memory": "Bytes of the pool resident adapters share, each at its own rank (2GiB); "
    "--max-loras still caps their number. Default: max-loras adapters of max-lora-rank.",
    "lora_modules": "Public adapters registered at start: name=path, as many as needed (with a "
    "models file: of its first model).",
    "allow_runtime_lora_updating": "Serve vLLM's /v1/load_lora_adapter (admin token).",
    "guided_compile_timeout": "Seconds a grammar may take to compile before a 400.",
    "guided_cache_size": "Compiled grammars kept (LRU).",
    "guided_max_schema_bytes": "Largest JSON schema, regex, grammar or choice list.",
    "guided_max_schema_depth": "Deepest JSON nesting of a schema.",
    "enable_auto_tool_choice": 'Serve tool_choice "auto": the model may answer or call tools.',
    "tool_call_parser": "The model's tool-call format: hermes, llama3_json or mistral.",
    "host": "Address to listen on.",
    "port": "Port to listen on.",
    "max_body_bytes": "Largest request body (413 past it).",
    "max_n": "Largest n (choices per prompt).",
    "max_prompt_chars": "Longest prompt text. Default: 32 x max-model-len.",
    "shutdown_grace": "Seconds running requests get to finish on SIGTERM.",
    "database_url": "SQLAlchemy URL: SQLite (default) or postgresql://.",
    "db_upgrade": "Migrate the database to the latest schema at start.",
    "redis_url": "Redis for rate limits shared by replicas (redis://host:6379/0).",
    "redis_failure_mode": "Redis unreachable: open (limit in process) or closed (503).",
    "redis_timeout": "Seconds a Redis connect or read may take before it counts as down.",
    "redis_key_prefix": "Prefix of the limiter's Redis keys (several deployments, one Redis).",
    "concurrency_lease": "Seconds before a concurrency slot a dead replica held frees itself.",
    "default_rpm_limit": "Requests per minute of a new tenant that names none.",
    "default_tpm_limit": "Tokens per minute of a new tenant that names none.",
    "default_max_concurrency": "Requests in flight of a new tenant that names none.",
    "default_monthly_token_quota": "Tokens per calendar month (UTC) of a new tenant.",
    "metrics_max_tenants": "Tenants with Prometheus series of their own; the rest are `other`.",
    "secret_key": "Key for cache salts and admin tokens. Default: generated into a file.",
    "auth": "Require API keys; --no-auth serves everyone as `demo` (loopback only).",
    "metrics_auth": "/metrics needs an admin token.",
    "tenant_cache_ttl": "Seconds keys, suspensions and adapter names are cached.",
    "demo_tenant": "On an empty database, create tenant `demo` and print its key once.",
    "adapter_store": "Directory of uploaded adapters (content-addressed).",
    "max_adapter_bytes": "Largest adapter upload (413 past it).",
    "allow_local_adapter_paths": "Admins may register server-local adapter directories.",
    "admin_jwt_algorithm": "HS256 (a shared key) or RS256 (an identity provider's JWKS).",
    "admin_jwt_secret": "HS256 key for admin tokens. Default: derived from the secret key.",
    "admin_jwt_jwks": "RS256: JWKS file or URL of the identity provider.",
    "admin_jwt_issuer": "Required `iss` of admin tokens.",
    "admin_jwt_audience": "Required `aud` of admin tokens.",
    "console_oauth_authorize_url": "The console's sign-in with the identity provider: its "
    "authorization endpoint (OAuth 2.0 code flow with PKCE; the tokens it issues must pass "
    "--admin-jwt-jwks). Default: none (sign in by pasting an admin token).",
    "console_oauth_token_url": "The identity provider's token endpoint.",
    "console_oauth_client_id": "The console's client id at the identity provider.",
    "console_oauth_client_secret": "The console's client secret, for a provider that wants "
    "one besides PKCE. Default: none (a public client).",
    "console_oauth_scope": "Scopes the console asks for (the admin REST needs `admin`).",
    "console_oauth_redirect_url": "The callback registered at the provider. Default: this "
    "server's /console/oauth/callback as the browser reaches it.",
    "usage_spool_dir": "Usage rows' durable spool. Default: loragate-spool beside a SQLite db.",
    "usage_flush_interval": "Seconds between the usage ledger's batched database writes.",
    "responses_ttl": "Seconds a stored response (/v1/responses) is kept, and a conversation "
    "(/v1/conversations) after its last write: 30 days.",
    "responses_max_stored_per_tenant": "Stored responses per tenant, and conversations; past "
    "it the oldest go (conversations: the least recently written).",
    "responses_compact_keep_turns": "POST /v1/responses/compact keeps the last this many user "
    "turns of a conversation whole and summarises what came before.",
    "responses_compact_summary_tokens": "The most tokens a compaction's summary takes (the model "
    "writes it, greedily).",
    "batch_file_max_bytes": "The largest file POST /v1/files takes (a batch's input; 413 past "
    "it): 200 MiB, as OpenAI's.",
    "batch_file_max_lines": "The most lines (requests) a batch's input file may have (413 past "
    "it): 50,000, as OpenAI's.",
    "files_max_per_tenant": "Files a tenant may hold (/v1/files); an upload past it is refused "
    "(a batch's output files count but are always written).",
    "batch_max_concurrency": "Batch lines (/v1/batches) this gateway keeps in its engines at "
    "once; it claims more as they finish.",
    "batch_token_limit": "Tokens (each line's prompt + max_tokens) a tenant's unfinished "
    "batches may hold, for a tenant without a cap of its own; a batch past it is a 429. "
    "Default: none (unlimited).",
    "batch_lease_seconds": "Seconds a gateway's claim on a batch line lasts unless renewed "
    "(every third of it while the line runs): a gateway that died leaves its lines to the "
    "others after this.",
    "batch_completion_window_seconds": "What a batch's completion_window `24h` means here: "
    "unfinished lines are expired this long after its creation.",
    "responses_sweep_interval": "Seconds between deletions of expired stored responses and "
    "conversations.",
}


def add_serve_command(app: typer.Typer, run: Callable[[Settings], None]) -> None:
    """Register `serve` on the app: every Settings field in HELP as a flag."""
    add_settings_command(
        app,
        "serve",
        list(HELP),
        run,
        "Serve the OpenAI-compatible API and the admin REST over the engine.",
    )


def add_settings_command(
    app: typer.Typer,
    name: str,
    fields: Sequence[str],
    run: Callable[[Settings], None],
    doc: str,
) -> None:
    """Register a command whose flags are these Settings fields; `run(settings)` runs it. Its
    signature is built from the fields, for typer to read."""

    def command(ctx: typer.Context, **values: Any) -> None:
        given = {k: v for k, v in values.items() if v is not None and v != []}
        # vLLM's form `--lora-modules a=path b=path` leaves the later pairs as extra args.
        modules = list(given.pop("lora_modules", [])) + list(ctx.args)
        if modules:
            given["lora_modules"] = modules
        try:
            settings = Settings(**given)
        except ValidationError as exc:
            first = exc.errors()[0]
            flag = "--" + str(first["loc"][0]).replace("_", "-") if first["loc"] else None
            raise typer.BadParameter(first["msg"], param_hint=flag) from exc
        if "cpu_isa" in fields:
            cpu_features.use_isa(settings.cpu_isa)  # before the first torch operation
        run(settings)

    params = [
        inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context)
    ]
    for field in fields:
        params.append(
            inspect.Parameter(
                field, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=_option(field)
            )
        )
    command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    command.__annotations__ = {p.name: p.annotation for p in params}
    command.__doc__ = doc
    extra_args = "lora_modules" in fields
    app.command(name, context_settings={"allow_extra_args": extra_args})(command)


def reference_rows() -> list[tuple[str, str, str, str]]:
    """(flag, variable, default, help) of every `serve` flag: the docs' reference page is
    made of these, so it lists exactly what the command takes."""
    rows = []
    for name in HELP:
        flag = "--" + name.replace("_", "-")
        if _python_type(Settings.model_fields[name].annotation) is bool:
            flag += " / --no-" + name.replace("_", "-")
        default = "" if "Default:" in HELP[name] else _default_shown(name)
        rows.append((flag, f"LORAGATE_{name.upper()}", default, HELP[name]))
    return rows


def _default_shown(name: str) -> str:
    field = Settings.model_fields[name]
    default = field.default_factory() if field.default_factory else field.default  # type: ignore[call-arg]
    if isinstance(default, SecretStr):
        return "set"
    return "none" if default in (None, []) else str(default)


def _option(name: str) -> Any:
    kind = _python_type(Settings.model_fields[name].annotation)
    env = f"env: LORAGATE_{name.upper()}"
    # A help text that says its default itself (a computed one) gets only the variable.
    extra = env if "Default:" in HELP[name] else f"default: {_default_shown(name)}; {env}"
    help = f"{HELP[name]} ({extra})"
    return Annotated[kind | None, typer.Option(help=help, show_default=False)]


def _python_type(annotation: Any) -> Any:
    """The plain type typer turns into a flag: bool, int, float, str, Path or list[str]."""
    args = [a for a in get_args(annotation) if a is not type(None)]
    origin = get_origin(annotation)
    if origin in (typing.Union, types.UnionType, typing.Annotated):
        return _python_type(args[0])
    if origin is list:
        return list[str]
    if annotation in (bool, int, float, Path):
        return annotation
    return str
