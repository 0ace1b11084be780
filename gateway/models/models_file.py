"""The models file: which base models one gateway serves, and each one's engine.

`loragate serve --models-config models.yaml` (`LORAGATE_MODELS_CONFIG`):

    models:
      - name: smollm2              # the `model` value clients send; unique
        path: models/smollm2       # a local Hugging Face checkpoint
        min_replicas: 1            # 0: scale to zero
        max_replicas: 1            # local engines this gateway may start for the model
        idle_timeout: 300          # seconds without requests before a replica above min stops
        scale_up_waiting: 1        # requests waiting beyond what the replicas run...
        scale_up_window: 1         # ...for this many seconds: another replica starts
        engine:                    # any engine knob of `loragate serve`, flag name with _
                                   # (gateway.models.engine_knobs.ENGINE_KNOBS)
          dtype: auto
          max_num_seqs: 64
        urls: []                   # engines started elsewhere (`loragate engine`)
        routing: affinity          # among them (--routing); picker: urls is one inference
                                   # gateway, whose endpoint picker chooses per request

`--model` alone is the one-entry file `[{name: --served-model-name or the directory's name,
path: --model}]`. An engine knob not named under `engine:` is the server's own (its flag, its
variable, its default). A bad file is one line naming the key, and the server does not start.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from engine.model_runner import CPU_DEFAULT_KV_CACHE_MEMORY
from gateway.models.engine_knobs import ENGINE_KNOBS
from gateway.settings import Settings, SettingsError, parse_bytes

# A model's name is what clients send as `model`; `@` is kept for `adapter@model`.
MODEL_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$"
MAX_MODEL_NAME = 128


class ModelEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=MAX_MODEL_NAME, pattern=MODEL_NAME_PATTERN)
    path: Path
    min_replicas: int = Field(default=1, ge=0)
    max_replicas: int = Field(default=1, ge=1)
    idle_timeout: float = Field(default=300.0, gt=0)
    # Scale-up to max_replicas: another local replica starts once this many requests have
    # waited beyond what the started ones run, for scale_up_window seconds without a break.
    scale_up_waiting: int = Field(default=1, ge=1)
    scale_up_window: float = Field(default=1.0, ge=0)
    engine: dict[str, Any] = Field(default_factory=dict)
    urls: list[str] = Field(default_factory=list)
    routing: Literal["affinity", "least_loaded", "round_robin", "picker"] | None = None

    @model_validator(mode="after")
    def _check(self) -> ModelEntry:
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"min_replicas ({self.min_replicas}) is above max_replicas ({self.max_replicas})"
            )
        for url in self.urls:
            if not re.fullmatch(r"https?://[^/\s]+/?", url):
                raise ValueError(f"urls: {url!r} is not an engine's http(s)://host:port")
        unknown = sorted(set(self.engine) - set(ENGINE_KNOBS))
        if unknown:
            raise ValueError(
                f"engine: {unknown[0]!r} is not an engine knob (one of: {', '.join(ENGINE_KNOBS)})"
            )
        return self


class ModelsFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    models: list[ModelEntry] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique(self) -> ModelsFile:
        seen: set[str] = set()
        for entry in self.models:
            if entry.name in seen:
                raise ValueError(f"two models are named {entry.name!r}")
            seen.add(entry.name)
        return self


@dataclass(frozen=True, slots=True)
class ServedModelSpec:
    """One base model as the server runs it: its entry, and the settings its engines get
    (the server's, with the entry's path, name and engine knobs)."""

    entry: ModelEntry
    settings: Settings

    @property
    def name(self) -> str:
        return self.entry.name


def served_models(settings: Settings) -> list[ServedModelSpec]:
    """The models a server with these settings serves: its models file's, else `--model`'s.
    Raises SettingsError (one line naming the file and the key) for a file that will not do."""
    if settings.models_config is None:
        name = settings.served_model_name or Path(settings.model).resolve().name
        entry = ModelEntry(name=name, path=Path(settings.model))
        check_picker(settings.routing, entry, None)
        return [ServedModelSpec(entry=entry, settings=settings)]
    if settings.served_model_name is not None:
        raise SettingsError(
            "--served-model-name names the one model of --model; "
            "with --models-config each model's `name` is its own"
        )
    models = read_models_file(settings.models_config)
    specs = [ServedModelSpec(entry=m, settings=_engine_settings(settings, m)) for m in models]
    check_memory(specs, settings.models_config)
    return specs


def check_memory(specs: list[ServedModelSpec], path: Path, available: int | None = None) -> None:
    """Every model at max_replicas must fit in this machine's memory together: weights (their
    files' size, an upper bound) and KV pool per engine. CUDA engines are sized by
    memory_utilization on their device instead, and are not counted here."""
    lines, total = [], 0
    for spec in specs:
        s = spec.settings
        if s.device == "cuda" or spec.entry.urls:  # engines elsewhere use none of this memory
            continue
        kv = parse_bytes(s.kv_cache_memory) if s.kv_cache_memory else CPU_DEFAULT_KV_CACHE_MEMORY
        weights = sum(f.stat().st_size for f in spec.entry.path.glob("*.safetensors"))
        need = spec.entry.max_replicas * (weights + kv)
        total += need
        lines.append(
            f"{spec.name} {spec.entry.max_replicas} x ({_gib(weights)} weights + {_gib(kv)} KV)"
        )
    memory = machine_memory() if available is None else available
    if total > memory:
        raise SettingsError(
            f"{path}: the models do not fit in this machine's {_gib(memory)} of memory: "
            f"{' + '.join(lines)} = {_gib(total)}; lower their engine.kv_cache_memory "
            "or max_replicas"
        )


def machine_memory() -> int:
    """Bytes of memory this process may use: the machine's, or its cgroup's limit."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
    except OSError:
        return memory
    return min(memory, int(limit)) if limit.isdigit() else memory


def _gib(size: int) -> str:
    return f"{size / 2**30:.2f} GiB"


def read_models_file(path: Path) -> list[ModelEntry]:
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise SettingsError(f"{path}: {exc.strerror or exc}") from exc
    except yaml.YAMLError as exc:
        raise SettingsError(f"{path}: not YAML: {_one_line(str(exc))}") from exc
    try:
        models = ModelsFile.model_validate(data).models
    except ValidationError as exc:
        raise SettingsError(f"{path}: {_first_error(exc)}") from exc
    for index, entry in enumerate(models):
        if not (entry.path / "config.json").is_file():
            raise SettingsError(
                f"{path}: models[{index}].path: {entry.path} is not a Hugging Face model "
                "directory (no config.json)"
            )
    return models


def _engine_settings(settings: Settings, entry: ModelEntry) -> Settings:
    # Validated as flags are: the knobs' types, bounds and validators.
    merged = settings.model_dump() | entry.engine
    merged |= {"model": str(entry.path), "served_model_name": entry.name}
    if entry.routing is not None:
        merged["routing"] = entry.routing
    try:
        merged_settings = Settings(**merged)
    except ValidationError as exc:
        raise SettingsError(
            f"{settings.models_config}: {entry.name}: engine.{_first_error(exc)}"
        ) from exc
    check_picker(merged_settings.routing, entry, settings.models_config)
    return merged_settings


def check_picker(routing: str, entry: ModelEntry, where: Path | None) -> None:
    """`routing: picker` sends every request to one address: the entry names exactly one."""
    if routing == "picker" and len(entry.urls) != 1:
        raise SettingsError(
            f"{where or '--routing'}: {entry.name}: routing picker sends each request to one "
            f"inference gateway, so urls names exactly one (it names {len(entry.urls)})"
        )


def _first_error(exc: ValidationError) -> str:
    error = exc.errors()[0]
    where = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in error["loc"])
    message = str(error["msg"]).removeprefix("Value error, ")
    return f"{where.lstrip('.')}: {message}" if where else message


def _one_line(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()
