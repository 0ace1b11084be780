"""deploy/docker and deploy/compose, checked without a container runtime: every `loragate`
subcommand and flag they name exists (its `--help` lists it), every `LORAGATE_*` variable is a
setting, torch is pinned as pyproject.toml pins it, the images run as a user other than root
with a /health check on the port they expose, the compose file's services, dependencies and
models file hold together, and `docker compose config` accepts it where that CLI exists."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from bench.servers import LORAGATE_CLI
from gateway.cli.serve_flags import HELP
from gateway.engine_service.command import ENGINE_COMMAND_FIELDS
from gateway.models.engine_knobs import ENGINE_KNOBS
from gateway.models.models_file import ModelsFile, read_models_file
from gateway.settings import Settings
from kernels import native

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = [
    ROOT / "deploy" / "docker" / "Dockerfile",
    ROOT / "deploy" / "docker" / "Dockerfile.cuda",
]
COMPOSE = ROOT / "deploy" / "compose" / "compose.yaml"
MODELS = ROOT / "deploy" / "compose" / "models.yaml"
# Variables read outside the settings: kernels/native.py's cache directory and switch.
OTHER_VARIABLES = {"LORAGATE_KERNEL_CACHE", native.ENV_DISABLE}
SETTINGS_FLAGS = {
    "serve": {_f.replace("_", "-") for _f in HELP},
    "engine": {_f.replace("_", "-") for _f in (*ENGINE_COMMAND_FIELDS, *ENGINE_KNOBS)},
}


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    result, pending = [], ""
    for line in path.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending += line.rstrip().removesuffix("\\") + " " if line.rstrip().endswith("\\") else line
        if not line.rstrip().endswith("\\"):
            word, _, rest = pending.strip().partition(" ")
            result.append((word.upper(), rest.strip()))
            pending = ""
    return result


def exec_form(arguments: str) -> list[str]:
    return list(yaml.safe_load(arguments))  # a JSON array is YAML


def documented_commands(path: Path) -> list[list[str]]:
    """The `loragate ...` command lines a file's comments show: in backticks, and the
    arguments after an image name `loragate:TAG` in `docker run` examples."""
    comments = "\n".join(
        line.lstrip()[1:] for line in path.read_text().splitlines() if line.lstrip().startswith("#")
    )
    commands = [shlex.split(c) for c in re.findall(r"`loragate ([^`]+)`", comments)]
    joined = re.sub(r"\\\n\s*", " ", comments)
    commands += [shlex.split(c) for c in re.findall(r"\bloragate:[\w.-]+ +(.+)", joined)]
    return commands


def check_command(args: list[str], helps: dict[tuple[str, ...], str]) -> None:
    """Its subcommand exists and lists every flag given (`--help` of that subcommand)."""
    path: list[str] = []
    for token in args:
        if not re.fullmatch(r"[a-z][a-z0-9-]*", token):
            break
        path.append(token)
    key = tuple(path)
    if key not in helps:
        done = subprocess.run(
            [LORAGATE_CLI, *path, "--help"], capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, f"loragate {' '.join(path)}: {done.stderr}"
        helps[key] = done.stdout
    flags = [t.split("=")[0] for t in args if t.startswith("--")]
    for flag in flags:
        assert re.search(rf"{re.escape(flag)}\b", helps[key]), f"loragate {' '.join(path)} {flag}"
        if path and path[0] in SETTINGS_FLAGS and flag not in ("--help",):
            name = flag.removeprefix("--no-") if flag.startswith("--no-") else flag
            assert name.removeprefix("--") in SETTINGS_FLAGS[path[0]], flag


def check_variables(names: list[str]) -> None:
    fields = {f"LORAGATE_{f.upper()}" for f in Settings.model_fields}
    for name in names:
        if name.startswith("LORAGATE_"):
            assert name in fields | OTHER_VARIABLES, f"{name} is not a setting"


@pytest.fixture(scope="module")
def helps() -> dict[tuple[str, ...], str]:
    return {}


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_a_dockerfiles_commands_and_variables_exist(
    dockerfile: Path, helps: dict[tuple[str, ...], str]
) -> None:
    steps = instructions(dockerfile)
    entrypoint = [exec_form(a) for i, a in steps if i == "ENTRYPOINT"]
    cmd = [exec_form(a) for i, a in steps if i == "CMD"]
    assert entrypoint == [["loragate"]]
    assert cmd == [["serve", "--host", "0.0.0.0"]]
    check_command(cmd[0], helps)
    for command in documented_commands(dockerfile):
        check_command(command, helps)
    env = " ".join(a for i, a in steps if i == "ENV")
    check_variables(re.findall(r"\b(LORAGATE_\w+)=", env))
    assert native.ENV_DISABLE not in env  # the image's kernels are on


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_a_dockerfile_pins_torch_as_pyproject_does(dockerfile: Path) -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    pinned = [d for d in pyproject["project"]["dependencies"] if d.startswith("torch==")]
    runs = [a for i, a in instructions(dockerfile) if i == "RUN"]
    installs = [r for r in runs if re.search(r"pip install\b.*\btorch\b", r)]
    assert len(installs) == 1, installs
    assert re.findall(r"\btorch==[\w.+]+", installs[0]) == pinned
    assert "--index-url" in installs[0]
    if dockerfile.name == "Dockerfile":
        assert "https://download.pytorch.org/whl/cpu" in installs[0]
    else:
        base = re.search(r"ARG CUDA_IMAGE=(\S+)", dockerfile.read_text())
        index = re.search(r"ARG TORCH_INDEX=(\S+)", dockerfile.read_text())
        assert base is not None and index is not None
        # A pinned nvidia/cuda runtime tag, and the wheel index of the same CUDA version.
        tag = re.fullmatch(r"nvidia/cuda:(\d+)\.(\d+)\.\d+-runtime-[\w.]+", base.group(1))
        assert tag is not None, base.group(1)
        assert index.group(1) == f"https://download.pytorch.org/whl/cu{tag[1]}{tag[2]}"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_a_dockerfile_runs_as_a_user_with_a_health_check(dockerfile: Path) -> None:
    steps = instructions(dockerfile)
    stages = [i for i, (word, _) in enumerate(steps) if word == "FROM"]
    final = steps[stages[-1] :]
    users = [a for i, a in final if i == "USER"]
    assert users and users[-1] not in ("root", "0") and not users[-1].startswith("0:")
    # The kernels are compiled at build (the CPU image) by kernels.native.load().
    if dockerfile.name == "Dockerfile":
        assert any("native.load()" in a for i, a in steps if i == "RUN")
    checks = [a for i, a in final if i == "HEALTHCHECK"]
    assert len(checks) == 1 and "urllib.request" in checks[0]
    port = Settings.model_fields["port"].default
    assert "'/health'" in checks[0] and f"'{port}'" in checks[0]
    assert [a for i, a in final if i == "EXPOSE"] == [str(port)]


def test_dockerignore_keeps_out_what_the_image_does_not_need() -> None:
    ignored = (ROOT / ".dockerignore").read_text().split()
    for path in (".git", ".venv", "models", "tests", "**/__pycache__", "*.db"):
        assert path in ignored
    copied = [
        a.split()[0]
        for d in DOCKERFILES
        for i, a in instructions(d)
        if i == "COPY" and not a.startswith("--from")
    ]
    assert not set(copied) & set(ignored), "a file the Dockerfile copies is ignored"


# -- compose --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(data, dict)
    return data


def _service_command(service: dict[str, Any]) -> list[list[str]]:
    """The loragate command lines a service runs (in a shell script, each `loragate ...`)."""
    if not str(service.get("image", "")).startswith("loragate:"):
        return []  # postgres, redis
    command = service.get("command", [])
    if service.get("entrypoint", ["loragate"])[:2] == ["sh", "-c"]:
        script = " ".join(command)
        return [shlex.split(c) for c in re.findall(r"\bloragate ([^&|;)]+)", script)]
    return [command] if command else []


def test_every_compose_command_and_variable_exists(
    compose: dict[str, Any], helps: dict[tuple[str, ...], str]
) -> None:
    commands = 0
    for service in compose["services"].values():
        for command in _service_command(service):
            check_command(command, helps)
            commands += 1
        check_variables(list(service.get("environment", {})))
    assert commands >= 5  # migrate, models (two), two engines, the gateway
    for command in documented_commands(COMPOSE):
        check_command(command, helps)


def test_compose_dependencies_health_and_volumes(compose: dict[str, Any]) -> None:
    services = compose["services"]
    for name, service in services.items():
        for target in service.get("depends_on", {}):
            assert target in services, f"{name} depends on {target}, not a service"
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if not source.startswith("."):
                assert source in compose["volumes"], f"{name}: volume {source}"
    gateway = services["gateway"]
    assert gateway["depends_on"]["migrate"] == {"condition": "service_completed_successfully"}
    assert services["migrate"]["command"] == ["db", "upgrade"]
    assert gateway["environment"]["LORAGATE_DB_UPGRADE"] == "false"
    for name in ("postgres", "redis", "gateway", "engine-demo", "engine-smollm2"):
        assert "test" in services[name]["healthcheck"], name
    mounts = {v.split(":")[1] for v in gateway["volumes"]}
    assert {"/var/lib/loragate/adapters", "/var/lib/loragate/spool"} <= mounts
    assert "/var/lib/postgresql/data" in {v.split(":")[1] for v in services["postgres"]["volumes"]}


def test_compose_secrets_come_from_the_env_file(compose: dict[str, Any]) -> None:
    text = COMPOSE.read_text()
    example = (ROOT / "deploy" / "compose" / ".env.example").read_text()
    needed = set(re.findall(r"\$\{(\w+):\?", text))
    given = set(re.findall(r"^(\w+)=", example, re.M))
    assert {"POSTGRES_PASSWORD", "LORAGATE_SECRET_KEY", "LORAGATE_ENGINE_TOKEN"} <= needed
    assert needed <= given
    ignored = subprocess.run(
        ["git", "check-ignore", "-q", "deploy/compose/.env"], cwd=ROOT, check=False
    )
    assert ignored.returncode == 0, "deploy/compose/.env is not in .gitignore"


def test_the_models_file_is_served_by_the_engine_services(
    compose: dict[str, Any], demo_model_dir: Path, tmp_path: Path
) -> None:
    data = yaml.safe_load(MODELS.read_text())
    models = ModelsFile.model_validate(data).models
    services = compose["services"]
    gateway = services["gateway"]
    assert "/etc/loragate/models.yaml" in gateway["command"]
    assert "./models.yaml:/etc/loragate/models.yaml:ro" in gateway["volumes"]
    for model in models:
        assert len(model.urls) == 1, model.name
        host, port = re.fullmatch(r"http://([\w-]+):(\d+)/?", model.urls[0]).groups()  # type: ignore[union-attr]
        engine = services[host]
        assert engine["command"][0] == "engine"
        flags = dict(zip(engine["command"][1::2], engine["command"][2::2], strict=False))
        assert flags["--model"] == str(model.path)
        assert flags["--served-model-name"] == model.name
        assert engine["environment"]["LORAGATE_PORT"] == port
        assert gateway["depends_on"][host] == {"condition": "service_healthy"}
    # The project's own loader, with the paths where a checkpoint is here.
    local = tmp_path / "models.yaml"
    local.write_text(re.sub(r"path: /models/\w+", f"path: {demo_model_dir}", MODELS.read_text()))
    assert [m.name for m in read_models_file(local)] == [m.name for m in models]


def test_docker_compose_accepts_the_file(tmp_path: Path) -> None:
    docker = shutil.which("docker")
    if docker is None:
        pytest.skip("no docker CLI here")
    if subprocess.run([docker, "compose", "version"], capture_output=True).returncode != 0:
        pytest.skip("the docker CLI here has no compose plugin")
    env = tmp_path / ".env"
    secret = "x" * 48
    env.write_text(
        f"POSTGRES_PASSWORD={secret}\nLORAGATE_SECRET_KEY={secret}\n"
        f"LORAGATE_ENGINE_TOKEN={secret}\nLORAGATE_PUBLISH_PORT=8000\n"
    )
    done = subprocess.run(
        [docker, "compose", "-f", str(COMPOSE), "--env-file", str(env), "config", "--quiet"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
