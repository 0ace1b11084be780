"""Every gateway knob in one typed object: `loragate serve` flags, `LORAGATE_*` environment
variables, defaults, in that order of precedence.

The CLI passes only the flags a user gave; pydantic-settings reads the environment and fills
the defaults. Secrets are checked here, once: a placeholder secret key is refused with a line
that says how to make a real one, and with none configured the first start generates one
into a file beside the database (mode 0600) and every later start, and `loragate admin
token`, reuse it.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import secrets
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from adapters.store import store_directory
from engine.spec_decode import SpeculativeConfig

PLACEHOLDER_SECRETS = {"changeme", "change-me", "secret", "password", "default", "test"}
MIN_SECRET_BYTES = 32
MAKE_A_SECRET = "python3 -c 'import secrets; print(secrets.token_urlsafe(48))'"


def parse_bytes(value: str) -> int:
    """'2GiB', '512MiB', '1G' or a plain byte count."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    text = value.strip().lower().removesuffix("b").removesuffix("i")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


class SettingsError(ValueError):
    """A setting that cannot be used; the message is one line a person can act on."""


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="LORAGATE_", extra="ignore")

    # -- the model and the engine ------------------------------------------------------------
    model: str = "models/smollm2"
    served_model_name: str | None = None
    # Several base models, each with its engine knobs (gateway/models/models_file.py);
    # None: --model.
    models_config: Path | None = None
    # Models that scale to zero (min_replicas 0): requests held while their engine starts.
    max_pending_per_model: int = Field(default=256, ge=1)
    cold_start_timeout: float = Field(default=60.0, gt=0.0)
    # Engine processes forked from one process that has imported the engine
    # (engine/frontend/zygote.py).
    zygote: bool = True
    # Engine processes started ahead, torch imported, for those models
    # (engine/frontend/warm_spare.py).
    spare_engines: int = Field(default=1, ge=0)
    # Heap a spare faults in while it waits, so the model it becomes loads into memory already
    # there (engine/heap.py): "auto" (what the largest of those models writes at its start,
    # up to 1GiB), a size (512MiB) or 0.
    spare_engine_memory: str = "auto"
    # Between a gateway and its `loragate engine`s: the engines trust tenant context (salt,
    # fairness key, adapter) only from a holder of this token.
    engine_token: SecretStr | None = None
    # How a model's replicas share its requests (gateway/models/routing.py); picker: an
    # inference gateway at the model's one url chooses per request (remote/picked_engine.py).
    routing: Literal["affinity", "least_loaded", "round_robin", "picker"] = "affinity"
    max_model_len: int | None = None
    block_size: int = 16
    kv_cache_memory: str | None = None
    memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    max_waiting: int = 1024
    scheduling_policy: Literal["fair", "priority", "fcfs"] = "fair"
    fair_delay_ratio: float = 0.5
    priority_max_wait: float = Field(default=30.0, gt=0, le=86400)
    priority_step_yield: bool = True
    # The band every batch line runs in (engine/priority.py): below interactive requests'
    # (0 unless they ask for worse), so batches take the capacity interactive traffic leaves.
    batch_priority: int = Field(default=100, ge=0, le=1_000_000)
    dtype: str = "auto"
    quantization: Literal["int8"] | None = None
    # vLLM's JSON, e.g. {"method": "ngram", "num_speculative_tokens": 4, ...}; None: off.
    speculative_config: str | None = None
    device: str = "auto"
    seed: int = 0
    num_threads: int | None = None
    prefill_threads: int | None = None
    engine_process: bool = True
    restart_engine: bool = True
    cpu_kernels: bool = True
    cpu_isa: Literal["native", "avx512", "avx2"] = "native"
    weights_cache_dir: str = "auto"
    kernels: Literal["auto", "triton", "native", "torch"] = "auto"
    enable_lora: bool = True
    max_loras: int = 4
    max_lora_rank: int = 16
    max_cpu_loras: int = 16
    lora_memory: str | None = None
    lora_modules: Annotated[list[str], NoDecode] = Field(default_factory=list)
    allow_runtime_lora_updating: bool = False
    guided_compile_timeout: float = 10.0
    guided_cache_size: int = 256
    guided_max_schema_bytes: int = 64 << 10
    guided_max_schema_depth: int = 32
    # Tool calling: tool_choice "auto" reads calls out of text in this format (vLLM's names).
    enable_auto_tool_choice: bool = False
    tool_call_parser: Literal["hermes", "llama3_json", "mistral"] | None = None

    # -- HTTP -----------------------------------------------------------------------------------
    host: str = "127.0.0.1"
    port: int = 8000
    max_body_bytes: int = 4 << 20
    max_n: int = Field(default=16, ge=1)
    max_prompt_chars: int | None = Field(default=None, ge=1)
    shutdown_grace: float = 10.0

    # -- tenancy --------------------------------------------------------------------------------
    database_url: str = "sqlite+aiosqlite:///./loragate.db"
    db_upgrade: bool = True  # run the migrations to head at start
    redis_url: str | None = None
    redis_failure_mode: Literal["open", "closed"] = "open"
    redis_timeout: float = Field(default=0.25, gt=0.0, le=30.0)  # seconds per connect or read
    redis_key_prefix: str = Field(default="loragate", min_length=1, max_length=64)
    # A concurrency slot a replica took and never gave back (it died) frees after this.
    concurrency_lease: float = Field(default=600.0, gt=0.0)
    # Limits a tenant gets at creation when the admin names none; None: unlimited.
    default_rpm_limit: int | None = Field(default=None, ge=1)
    default_tpm_limit: int | None = Field(default=None, ge=1)
    default_max_concurrency: int | None = Field(default=None, ge=1)
    default_monthly_token_quota: int | None = Field(default=None, ge=0)
    metrics_max_tenants: int = Field(default=100, ge=0)
    secret_key: SecretStr | None = None
    auth: bool = True  # False: every request is the demo tenant (loopback only)
    metrics_auth: bool = False  # /metrics needs an admin token
    # Keys, tenants' states and adapter names are cached in process this long (seconds).
    tenant_cache_ttl: float = Field(default=10.0, ge=0.0)
    demo_tenant: bool = True  # on an empty database, create `demo` and print its key once
    adapter_store: Path = Path("loragate-adapters")
    max_adapter_bytes: int = Field(default=1 << 30, ge=1)
    allow_local_adapter_paths: bool = False
    admin_jwt_algorithm: Literal["HS256", "RS256"] = "HS256"
    # HS256: a key of its own, or one derived from the secret key. RS256: the identity
    # provider's public keys, a JWKS file or URL.
    admin_jwt_secret: SecretStr | None = None
    admin_jwt_jwks: str | None = None
    admin_jwt_issuer: str | None = None
    admin_jwt_audience: str | None = None
    # The console's sign-in with the identity provider (gateway/console/oauth.py): the
    # authorization-code flow with PKCE. All three of authorize, token and client id, or none.
    console_oauth_authorize_url: str | None = Field(default=None, max_length=2048)
    console_oauth_token_url: str | None = Field(default=None, max_length=2048)
    console_oauth_client_id: str | None = Field(default=None, max_length=256)
    console_oauth_client_secret: SecretStr | None = None
    console_oauth_scope: str = Field(default="openid admin", max_length=1024)
    console_oauth_redirect_url: str | None = Field(default=None, max_length=2048)
    # The usage ledger's spool (tenants/ledger.py); None: `loragate-spool` beside a SQLite
    # database, else in the working directory.
    usage_spool_dir: Path | None = None
    usage_flush_interval: float = Field(default=0.5, gt=0.0, le=60.0)
    # The Responses API's stored responses (gateway/openai/responses): kept this long (seconds; 30
    # days, as OpenAI keeps them), at most this many per tenant (the oldest go first). The
    # Conversations API's conversations (gateway/openai/conversations) are kept and capped by the
    # same two, counted from a conversation's last write.
    responses_ttl: float = Field(default=30 * 86400.0, gt=0.0)
    responses_max_stored_per_tenant: int = Field(default=10_000, ge=1)
    responses_sweep_interval: float = Field(default=600.0, gt=0.0)
    # POST /v1/responses/compact (gateway/openai/responses/compaction.py): the last turns kept
    # whole, the rest summarised by the model in at most so many tokens.
    responses_compact_keep_turns: int = Field(default=2, ge=0, le=1000)
    responses_compact_summary_tokens: int = Field(default=256, ge=16, le=8192)
    # The Files API (gateway/openai/files): a batch input file's bytes and lines (OpenAI's
    # limits), checked at upload; files a tenant may hold (a batch's outputs count, never
    # refused). The bytes live under adapter_store's files/.
    batch_file_max_bytes: int = Field(default=200 << 20, ge=1)
    batch_file_max_lines: int = Field(default=50_000, ge=1)
    files_max_per_tenant: int = Field(default=1000, ge=1)
    # The Batch API (gateway/openai/batches): lines a gateway keeps in its engines at once;
    # tokens (prompt + max_tokens per line) a tenant's unfinished batches may hold, when the
    # tenant has no cap of its own (None: unlimited); how long a gateway's claim on a line
    # lasts unless renewed (a gateway that died leaves its lines to others after it); and
    # what a batch's completion_window "24h" means here, in seconds.
    batch_max_concurrency: int = Field(default=64, ge=1, le=100_000)
    batch_token_limit: int | None = Field(default=None, ge=0)
    batch_lease_seconds: float = Field(default=60.0, gt=0.0, le=86400.0)
    batch_completion_window_seconds: float = Field(default=86400.0, gt=0.0)

    @field_validator("lora_modules", mode="before")
    @classmethod
    def _split_modules(cls, value: object) -> object:
        # vLLM's form in one environment variable: "a=path b=path".
        return value.split() if isinstance(value, str) else value

    @field_validator("adapter_store", mode="before")
    @classmethod
    def _check_adapter_store(cls, value: object) -> object:
        # Before the Path, which would fold "s3://b" into "s3:/b", a directory named "s3:".
        return store_directory(value) if isinstance(value, str) else value

    @field_validator("spare_engine_memory")
    @classmethod
    def _check_spare_memory(cls, value: str) -> str:
        if value != "auto" and parse_bytes(value) < 0:  # a ValueError names a bad size
            raise ValueError("spare_engine_memory: a size (512MiB), 0 or auto")
        return value

    @field_validator("speculative_config")
    @classmethod
    def _check_speculative(cls, value: str | None) -> str | None:
        if value is not None:
            SpeculativeConfig.parse(value)  # a ValueError names what is wrong
        return value

    @property
    def secret_key_file(self) -> Path:
        """Where a generated secret key lives: beside a SQLite database, else here."""
        prefix = "sqlite+aiosqlite:///"
        if self.database_url.startswith(prefix):
            return Path(self.database_url.removeprefix(prefix)).parent / "loragate.secret"
        return Path("loragate.secret")

    @property
    def resolved_usage_spool_dir(self) -> Path:
        if self.usage_spool_dir is not None:
            return self.usage_spool_dir
        prefix = "sqlite+aiosqlite:///"
        if self.database_url.startswith(prefix):
            return Path(self.database_url.removeprefix(prefix)).parent / "loragate-spool"
        return Path("loragate-spool")

    def resolved_secret_key(self) -> bytes:
        """The secret key: configured, or read from (first made into) the key file. Raises
        SettingsError for a placeholder or a short one."""
        if self.secret_key is not None:
            return check_secret(self.secret_key.get_secret_value(), "LORAGATE_SECRET_KEY")
        path = self.secret_key_file
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_urlsafe(48) + "\n")
        return check_secret(path.read_text().strip(), str(path))

    def admin_hs256_key(self) -> bytes:
        if self.admin_jwt_secret is not None:
            return check_secret(self.admin_jwt_secret.get_secret_value(), "admin JWT secret")
        return derive(self.resolved_secret_key(), "admin-jwt")

    def check_tool_choice(self) -> None:
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise SettingsError(
                "--enable-auto-tool-choice needs --tool-call-parser (hermes, llama3_json or "
                "mistral): the format the model writes its calls in"
            )

    def check_engine_token(self) -> None:
        """`loragate engine` without a token trusts whoever connects: loopback only."""
        if self.engine_token is None and not _is_loopback(self.host):
            raise SettingsError(
                f"an engine without --engine-token trusts every caller: it binds only a "
                f"loopback address, not {self.host}"
            )
        if self.engine_token is not None:
            check_secret(self.engine_token.get_secret_value(), "--engine-token")

    def check_no_auth(self) -> None:
        if not self.auth and not _is_loopback(self.host):
            raise SettingsError(
                f"--no-auth serves every request as the demo tenant: it binds only a loopback "
                f"address, not {self.host}"
            )


def check_secret(value: str, where: str) -> bytes:
    if value.lower() in PLACEHOLDER_SECRETS or len(value.encode()) < MIN_SECRET_BYTES:
        raise SettingsError(
            f"{where} is a placeholder or shorter than {MIN_SECRET_BYTES} bytes; make a real "
            f"one with: {MAKE_A_SECRET}"
        )
    return value.encode()


def derive(key: bytes, purpose: str) -> bytes:
    """A key for one purpose from the secret key (HMAC-SHA256), so purposes never share one."""
    return hmac.new(key, purpose.encode(), hashlib.sha256).digest()


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
