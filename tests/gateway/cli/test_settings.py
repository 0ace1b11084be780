"""Settings: flags over environment over defaults; secrets checked once, generated when absent."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from gateway.models.engine_knobs import engine_config
from gateway.settings import MAKE_A_SECRET, Settings, SettingsError


def test_flags_beat_the_environment_which_beats_the_defaults(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert Settings().max_n == 16
    monkeypatch.setenv("LORAGATE_MAX_N", "4")
    monkeypatch.setenv("LORAGATE_LORA_MODULES", "a=/x b=/y")
    assert Settings().max_n == 4
    assert Settings(max_n=8).max_n == 8
    assert Settings().lora_modules == ["a=/x", "b=/y"]  # vLLM's form, in one variable


@pytest.mark.parametrize("secret", ["changeme", "secret", "short-but-not-placeholder"])
def test_a_placeholder_secret_is_refused_with_how_to_make_one(secret: str) -> None:
    with pytest.raises(SettingsError) as refused:
        Settings(secret_key=secret).resolved_secret_key()
    message = str(refused.value)
    assert MAKE_A_SECRET in message and "\n" not in message


def test_without_a_secret_one_is_generated_beside_the_database_and_reused(tmp_path: Path) -> None:
    settings = Settings(database_url=f"sqlite+aiosqlite:///{tmp_path}/data/loragate.db")
    first = settings.resolved_secret_key()
    path = tmp_path / "data" / "loragate.secret"
    assert path.exists() and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert settings.resolved_secret_key() == first and len(first) >= 32
    path.write_text("changeme\n")  # a placeholder in the file is refused too
    with pytest.raises(SettingsError):
        settings.resolved_secret_key()


@pytest.mark.parametrize(
    ("host", "allowed"),
    [
        ("127.0.0.1", True),
        ("::1", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("10.1.2.3", False),
    ],
)
def test_no_auth_binds_only_loopback(host: str, allowed: bool) -> None:
    settings = Settings(auth=False, host=host)
    if allowed:
        settings.check_no_auth()
    else:
        with pytest.raises(SettingsError, match="loopback"):
            settings.check_no_auth()


def test_the_limiter_knobs_reach_the_limiter(
    tmp_path: Path, demo_model_dir: Path, redis_url: str
) -> None:
    from live_server import make_tenancy

    from gateway.tenancy.ratelimit.redis_limiter import RedisLimiter

    server = make_tenancy(
        tmp_path,
        demo_model_dir,
        "demo",
        redis_url=redis_url,
        redis_key_prefix="lg-knobs",
        redis_timeout=1.5,
        concurrency_lease=42.0,
    )
    limiter = server.tenancy.limiter
    assert isinstance(limiter, RedisLimiter)
    assert limiter.key_prefix == "lg-knobs" and limiter.lease == 42.0
    assert limiter.redis.connection_pool.connection_kwargs["socket_timeout"] == 1.5
    assert limiter.fallback.lease == 42.0


def test_the_fair_delay_ratio_reaches_the_engine_and_is_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("LORAGATE_FAIR_DELAY_RATIO", "1.5")
    assert engine_config(Settings(model="m")).fair_delay_ratio == 1.5
    assert engine_config(Settings(model="m", fair_delay_ratio=0.25)).fair_delay_ratio == 0.25
    with pytest.raises(ValueError, match="fair_delay_ratio"):
        engine_config(Settings(model="m", fair_delay_ratio=0.0))
