"""deploy/k8s against Kubernetes' schemas and against the code it runs.

Every document must parse, validate against Kubernetes' own schemas (kubernetes-validate) or
the vendored CRD schemas (tests/deploy/schemas), and render through kustomize in both
overlays. Then the containers that run `loragate` are read as the CLI would read them: their
subcommand, flags and LORAGATE_* variables must exist, their ports and probes must be the port
they listen on, and the models file must load. Nothing is downloaded.
"""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import jsonschema
import kubernetes_validate
import pytest
import typer
import yaml

from gateway.cli.admin import register
from gateway.cli.serve_flags import HELP, add_serve_command, add_settings_command
from gateway.engine_service.command import ENGINE_COMMAND_FIELDS
from gateway.models.engine_knobs import ENGINE_KNOBS
from gateway.models.models_file import ModelsFile
from gateway.remote.picker_wire import GENERATE_ROUTE
from gateway.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
SCHEMAS = Path(__file__).resolve().parent / "schemas"
OVERLAYS = ("cpu", "gpu")
KUBERNETES_VERSION = "1.32.0"  # the oldest minor the manifests are meant for (kubectl's here)
IMAGE = "ghcr.io/loragate/loragate"
# Files that are not applied: kustomize's own, and the Secret example (never applied as is).
NOT_RESOURCES = {"kustomization.yaml", "secret.example.yaml"}
# Variables the code reads besides the Settings fields, by the command that reads them.
EXTRA_ENV = {"engine": {"LORAGATE_KERNEL_CACHE"}}  # kernels/native.py


# -- reading ----------------------------------------------------------------------------------


def yaml_files() -> list[Path]:
    return sorted(K8S.rglob("*.yaml"))


def documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def resources() -> list[tuple[str, dict[str, Any]]]:
    """(where, document) of every object the sources would apply: overlays' and kustomize's
    files and the Secret example left out."""
    found = []
    for path in yaml_files():
        if path.name in NOT_RESOURCES or "overlays" in path.parts:
            continue
        for index, doc in enumerate(documents(path)):
            found.append((f"{path.relative_to(ROOT)}[{index}]", doc))
    return found


def inference_ready() -> bool:
    return (K8S / "base" / "inference" / "kustomization.yaml").is_file()


@cache
def rendered(overlay: str) -> tuple[dict[str, Any], ...]:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed: kustomize cannot render the overlays")
    if not inference_ready():
        pytest.skip("deploy/k8s/base/inference has no kustomization.yaml yet (its own task)")
    out = subprocess.run(
        ["kubectl", "kustomize", str(K8S / "overlays" / overlay)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d is not None)


def of_kind(docs: Any, kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d.get("kind") == kind]


def pod_spec(doc: dict[str, Any]) -> dict[str, Any] | None:
    if doc.get("kind") in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
        return doc["spec"]["template"]["spec"]
    return None


def containers(docs: Any) -> Iterator[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(the workload's name, its pod spec, a container) of every container and init one."""
    for doc in docs:
        spec = pod_spec(doc)
        if spec is None:
            continue
        for container in spec.get("initContainers", []) + spec["containers"]:
            yield doc["metadata"]["name"], spec, container


def loragate_containers(docs: Any) -> Iterator[tuple[str, dict[str, Any], dict[str, Any]]]:
    for name, spec, container in containers(docs):
        if container["image"].split(":")[0] == IMAGE:
            yield name, spec, container


# -- schemas ----------------------------------------------------------------------------------


@cache
def crd_schemas() -> dict[tuple[str, str], dict[str, Any]]:
    schemas = {}
    for path in SCHEMAS.glob("*.yaml"):
        data = yaml.safe_load(path.read_text())
        schemas[(data["apiVersion"], data["kind"])] = closed(data["schema"])
    return schemas


def closed(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema with every object that lists its properties closed to others, as the API
    server's strict field validation treats a structural schema."""
    schema = copy.deepcopy(schema)

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if (
                "properties" in node
                and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")
            ):
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


def validate(doc: dict[str, Any], where: str) -> None:
    key = (doc.get("apiVersion"), doc.get("kind"))
    if key in crd_schemas():
        errors = sorted(jsonschema.Draft7Validator(crd_schemas()[key]).iter_errors(doc), key=str)
        if errors:
            pytest.fail(f"{where}: {key[1]}: {errors[0].message} at {list(errors[0].path)}")
        return
    try:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.SchemaNotFoundError:
        pytest.fail(f"{where}: no schema for {key}: vendor its CRD under tests/deploy/schemas")
    except kubernetes_validate.ValidationError as exc:
        pytest.fail(f"{where}: {exc.message} at {list(exc.path)}")


# -- the CLI ----------------------------------------------------------------------------------


@cache
def cli() -> Any:
    """`loragate`'s commands the manifests run, registered as gateway.cli.main registers them."""
    app = typer.Typer()
    add_serve_command(app, lambda settings: None)
    add_settings_command(
        app, "engine", [*ENGINE_COMMAND_FIELDS, *ENGINE_KNOBS], lambda settings: None, ""
    )
    register(app)
    return typer.main.get_command(app)


def command_of(args: list[str]) -> tuple[list[str], Any, list[str]]:
    """(the subcommand's path, its (typer's click) command, the arguments after it)."""
    path: list[str] = []
    command = cli()
    rest = list(args)
    while hasattr(command, "commands"):  # a group
        assert rest, f"`loragate {' '.join(path)}` needs a subcommand"
        name = rest.pop(0)
        sub = command.commands.get(name)
        assert sub is not None, f"`loragate {' '.join(path)}` has no subcommand {name!r}"
        path.append(name)
        command = sub
    return path, command, rest


def flags(args: list[str]) -> dict[str, str | None]:
    """--flag value pairs (a flag followed by another, or last, has no value)."""
    given: dict[str, str | None] = {}
    for index, arg in enumerate(args):
        if arg.startswith("--"):
            follows = args[index + 1] if index + 1 < len(args) else None
            given[arg] = None if follows is None or follows.startswith("--") else follows
    return given


def settings_fields(path: list[str]) -> set[str]:
    """The Settings fields a command reads from LORAGATE_* variables."""
    if path == ["serve"]:
        return set(HELP)
    if path == ["engine"]:
        return set(ENGINE_COMMAND_FIELDS) | set(ENGINE_KNOBS)
    return set(Settings.model_fields)  # the operators' commands read Settings() whole


def container_args(container: dict[str, Any]) -> list[str]:
    command = container.get("command", [])
    if command:
        assert command[0] in ("loragate", "/usr/local/bin/loragate"), container["name"]
    return [*command[1:], *container.get("args", [])]


def env_value(container: dict[str, Any], name: str) -> str | None:
    for var in container.get("env", []):
        if var["name"] == name:
            return var.get("value")
    return None


def listen_port(container: dict[str, Any], path: list[str]) -> int:
    given = flags(command_of(container_args(container))[2])
    port = given.get("--port") or env_value(container, "LORAGATE_PORT")
    return int(port) if port is not None else int(Settings.model_fields["port"].default)


def resolve_port(container: dict[str, Any], port: int | str) -> int:
    if isinstance(port, int):
        return port
    named = {p.get("name"): p["containerPort"] for p in container.get("ports", [])}
    assert port in named, f"{container['name']}: no container port named {port!r}"
    return int(named[port])


def probes(container: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        if kind in container:
            yield kind, container[kind]


# -- (1) parsing ------------------------------------------------------------------------------


def test_every_yaml_file_parses() -> None:
    files = yaml_files()
    assert any(f.name == "kustomization.yaml" for f in files)
    for path in files:
        docs = documents(path)
        assert docs, f"{path}: empty"
        for doc in docs:
            assert isinstance(doc, dict) and "kind" in doc, f"{path}: a document without kind"


# -- (2), (3) schemas -------------------------------------------------------------------------


@pytest.mark.parametrize(("where", "doc"), resources(), ids=[where for where, _ in resources()])
def test_source_documents_validate(where: str, doc: dict[str, Any]) -> None:
    validate(doc, where)


def test_secret_example_validates_and_is_never_applied() -> None:
    (secret,) = documents(K8S / "base" / "secret.example.yaml")
    validate(secret, "secret.example.yaml")
    assert "not to be applied" in (K8S / "base" / "secret.example.yaml").read_text()
    for path in K8S.rglob("kustomization.yaml"):
        kustomization = yaml.safe_load(path.read_text())
        assert "secret.example.yaml" not in kustomization.get("resources", []), path
        assert "secretGenerator" not in kustomization, path
    assert not of_kind([d for _, d in resources()], "Secret"), "Secrets' values are the user's"


def test_closed_schemas_refuse_an_unknown_field() -> None:
    """The vendored schemas catch a misspelt field (they are closed, see closed())."""
    (scaled,) = of_kind([d for _, d in resources()], "ScaledObject")
    wrong = copy.deepcopy(scaled)
    wrong["spec"]["minReplicas"] = 0
    with pytest.raises(pytest.fail.Exception, match="minReplicas"):
        validate(wrong, "a misspelt ScaledObject")


# -- (4) kustomize ----------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_and_validates(overlay: str) -> None:
    docs = rendered(overlay)
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service", "Job", "ConfigMap", "ScaledObject"} <= kinds
    assert {"HorizontalPodAutoscaler", "PodDisruptionBudget", "NetworkPolicy"} <= kinds
    assert {"InferencePool", "HTTPRoute"} <= kinds
    for index, doc in enumerate(docs):
        validate(doc, f"kubectl kustomize overlays/{overlay} [{index}] {doc['kind']}")


def engine_deployments(docs: Any) -> list[dict[str, Any]]:
    return [
        d
        for d in of_kind(docs, "Deployment")
        if d["metadata"]["labels"].get("app.kubernetes.io/component") == "engine"
    ]


def test_cpu_overlay_engines() -> None:
    engines = engine_deployments(rendered("cpu"))
    assert engines
    for doc in engines:
        (container,) = doc["spec"]["template"]["spec"]["containers"]
        given = flags(container["args"])
        assert given["--dtype"] == "auto" and given["--device"] == "cpu"
        assert container["resources"]["requests"]["cpu"]
        assert "nvidia.com/gpu" not in container["resources"]["limits"]


def test_gpu_overlay_engines() -> None:
    docs = rendered("gpu")
    engines = engine_deployments(docs)
    assert engines
    for doc in engines:
        spec = doc["spec"]["template"]["spec"]
        (container,) = spec["containers"]
        assert container["resources"]["requests"]["nvidia.com/gpu"] == 1
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert container["image"].endswith("-cuda")
        assert flags(container["args"])["--device"] == "cuda"
        assert spec["nodeSelector"] and spec["tolerations"]
    # Only engines get GPUs and the CUDA image.
    for name, _, container in loragate_containers(docs):
        if not name.startswith("loragate-engine-"):
            assert not container["image"].endswith("-cuda"), name
            assert "nvidia.com/gpu" not in container["resources"].get("limits", {}), name


# -- (5) the manifests against the code ----------------------------------------------------


def manifest_sets() -> list[tuple[str, tuple[dict[str, Any], ...]]]:
    """The base's sources, and each overlay's rendering where kustomize can render it."""
    sets = [("base", tuple(d for _, d in resources()))]
    if shutil.which("kubectl") is not None and inference_ready():
        sets += [(f"overlays/{o}", rendered(o)) for o in OVERLAYS]
    return sets


@pytest.mark.parametrize(("name", "docs"), manifest_sets(), ids=[n for n, _ in manifest_sets()])
def test_loragate_containers_match_the_cli(name: str, docs: tuple[dict[str, Any], ...]) -> None:
    seen = set()
    for workload, _, container in loragate_containers(docs):
        where = f"{name}: {workload}/{container['name']}"
        path, command, rest = command_of(container_args(container))
        seen.add(" ".join(path))
        options = {o for p in command.params for o in (*p.opts, *p.secondary_opts)}
        for flag in flags(rest):
            assert flag in options, f"{where}: `loragate {' '.join(path)}` has no {flag}"
        allowed = {f"LORAGATE_{f.upper()}" for f in settings_fields(path)}
        allowed |= EXTRA_ENV.get(path[0], set())
        for var in container.get("env", []):
            if var["name"].startswith("LORAGATE_"):
                assert var["name"] in allowed, f"{where}: {var['name']} is read by nothing"
        for var in container.get("envFrom", []):
            pytest.fail(f"{where}: envFrom hides which variables are set: name them ({var})")
    assert {"serve", "engine", "db upgrade"} <= seen, seen


@pytest.mark.parametrize(("name", "docs"), manifest_sets(), ids=[n for n, _ in manifest_sets()])
def test_ports_and_probes(name: str, docs: tuple[dict[str, Any], ...]) -> None:
    for workload, _, container in loragate_containers(docs):
        where = f"{name}: {workload}/{container['name']}"
        path = command_of(container_args(container))[0]
        if path not in (["serve"], ["engine"]):
            assert "ports" not in container, where
            continue
        port = listen_port(container, path)
        given = flags(command_of(container_args(container))[2])
        assert given.get("--host") == "0.0.0.0", f"{where}: listens on loopback only"
        assert [p["containerPort"] for p in container["ports"]] == [port], where
        kinds = dict(probes(container))
        assert {"readinessProbe", "livenessProbe"} <= set(kinds), where
        for kind, probe in kinds.items():
            handler = probe.get("httpGet") or probe.get("tcpSocket")
            assert handler is not None, f"{where}: {kind} is neither httpGet nor tcpSocket"
            assert resolve_port(container, handler["port"]) == port, f"{where}: {kind} port"
            if "httpGet" in probe:
                assert probe["httpGet"]["path"] == "/health", f"{where}: {kind} path"
        if path == ["engine"]:
            # An engine's /health is its own engine's: readiness gates the InferencePool and
            # the gateway's link on it.
            assert all("httpGet" in p for p in kinds.values()), f"{where}: probe /health"
            assert any(v["name"] == "LORAGATE_ENGINE_TOKEN" for v in container["env"]), where


def test_secrets_are_references() -> None:
    for workload, _, container in containers(d for _, d in resources()):
        for var in container.get("env", []):
            if re.search(r"SECRET|TOKEN|DATABASE_URL|REDIS_URL", var["name"]):
                ref = var.get("valueFrom", {}).get("secretKeyRef")
                assert ref and ref["name"] == "loragate-secrets", f"{workload}: {var['name']}"


def test_engine_labels_services_and_policy() -> None:
    docs = [d for _, d in resources()]
    engines = engine_deployments(docs)
    assert engines
    services = {s["metadata"]["name"]: s for s in of_kind(docs, "Service")}
    (policy,) = [
        p
        for p in of_kind(docs, "NetworkPolicy")
        if p["spec"]["podSelector"]["matchLabels"].get("app.kubernetes.io/component") == "engine"
    ]
    peers = policy["spec"]["ingress"][0]["from"]
    assert {"podSelector": {"matchLabels": gateway_labels()}} in peers
    for doc in engines:
        labels = doc["spec"]["template"]["metadata"]["labels"]
        model = labels["loragate.dev/model"]
        assert labels["app.kubernetes.io/name"] == "loragate"
        assert labels["app.kubernetes.io/component"] == "engine"
        assert doc["spec"]["selector"]["matchLabels"] == labels
        service = services[doc["metadata"]["name"]]
        assert service["spec"]["clusterIP"] == "None", "engines' Service is headless"
        assert service["spec"]["selector"] == labels
        (container,) = doc["spec"]["template"]["spec"]["containers"]
        assert flags(container["args"])["--served-model-name"] == model
        assert container["resources"]["requests"] and container["resources"]["limits"]
        assert [p["port"] for p in policy["spec"]["ingress"][0]["ports"]] == [
            listen_port(container, ["engine"])
        ]


def gateway_labels() -> dict[str, str]:
    (gateway,) = [
        d
        for d in of_kind([d for _, d in resources()], "Deployment")
        if d["metadata"]["labels"].get("app.kubernetes.io/component") == "gateway"
    ]
    return dict(gateway["spec"]["template"]["metadata"]["labels"])


def test_pods_run_as_non_root_with_read_only_roots() -> None:
    for workload, spec, container in loragate_containers(d for _, d in resources()):
        assert spec["securityContext"]["runAsNonRoot"] is True, workload
        context = container["securityContext"]
        assert context["readOnlyRootFilesystem"] is True, workload
        assert context["allowPrivilegeEscalation"] is False, workload
        mounts = {m["mountPath"] for m in container.get("volumeMounts", [])}
        assert "/tmp" in mounts, f"{workload}: a read-only root needs a writable /tmp"


# -- the models file --------------------------------------------------------------------------


def models_file(docs: Any) -> tuple[ModelsFile, dict[str, Any]]:
    (gateway,) = [c for _, _, c in loragate_containers(docs) if container_args(c)[0] == "serve"]
    path = Path(flags(container_args(gateway))["--models-config"] or "")
    (mount,) = [m for m in gateway["volumeMounts"] if path.parent == Path(m["mountPath"])]
    (workload,) = [
        d
        for d in docs
        if d["kind"] == "Deployment" and gateway in d["spec"]["template"]["spec"]["containers"]
    ]
    (volume,) = [
        v for v in workload["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]
    ]
    (config,) = [
        c
        for c in of_kind(docs, "ConfigMap")
        if c["metadata"]["name"] == volume["configMap"]["name"]
    ]
    return ModelsFile.model_validate(yaml.safe_load(config["data"][path.name])), gateway


def test_models_file_loads_and_matches_the_engines() -> None:
    docs = [d for _, d in resources()]
    models, _ = models_file(docs)
    services = {s["metadata"]["name"]: s for s in of_kind(docs, "Service")}
    scaled = {s["spec"]["scaleTargetRef"]["name"]: s for s in of_kind(docs, "ScaledObject")}
    engines = {
        d["spec"]["template"]["metadata"]["labels"]["loragate.dev/model"]: d
        for d in engine_deployments(docs)
    }
    assert {m.name for m in models.models} == set(engines)
    for entry in models.models:
        Settings(**entry.engine)  # its knobs are Settings values, as the server checks them
        engine = engines[entry.name]
        (container,) = engine["spec"]["template"]["spec"]["containers"]
        assert flags(container["args"])["--model"] == str(entry.path)
        assert entry.urls, f"{entry.name}: engines run in their own pods: name them in urls"
        if entry.routing == "picker":
            picker_route_reaches(docs, entry.urls, engine, container)
        else:
            service_reaches(services, entry.urls, engine, container)
        # KEDA wakes it on the gateway's pending count and stops it after its idle_timeout.
        spec = scaled[engine["metadata"]["name"]]["spec"]
        assert spec["scaleTargetRef"]["kind"] == "Deployment"
        assert spec["minReplicaCount"] == entry.min_replicas == 0
        assert spec["cooldownPeriod"] == entry.idle_timeout
        (trigger,) = spec["triggers"]
        assert trigger["type"] == "prometheus"
        query = f'sum(loragate:model_pending_requests{{model="{entry.name}"}})'
        assert trigger["metadata"]["query"] == query
        assert trigger["metadata"]["serverAddress"].startswith("http")


def service_reaches(
    services: dict[str, dict[str, Any]],
    urls: list[str],
    engine: dict[str, Any],
    container: dict[str, Any],
) -> None:
    """The urls reach the engine's Service on the port the engine listens on."""
    for url in urls:
        parts = urlsplit(url)
        service = services[parts.hostname or ""]
        assert service["spec"]["selector"] == engine["spec"]["selector"]["matchLabels"]
        (port,) = service["spec"]["ports"]
        assert parts.port == port["port"]
        assert resolve_port(container, port["targetPort"]) == listen_port(container, ["engine"])


def picker_route_reaches(
    docs: list[dict[str, Any]], urls: list[str], engine: dict[str, Any], container: dict[str, Any]
) -> None:
    """`routing: picker`: the one url is the Gateway an HTTPRoute hangs from, which sends the
    gateway's per-request POSTs to an InferencePool of exactly this engine's pods, on the port
    the engine listens on."""
    (url,) = urls
    pools = {p["metadata"]["name"]: p for p in of_kind(docs, "InferencePool")}
    labels = engine["spec"]["template"]["metadata"]["labels"]
    routes = [
        r
        for r in of_kind(docs, "HTTPRoute")
        for rule in r["spec"]["rules"]
        for ref in rule["backendRefs"]
        if ref["kind"] == "InferencePool"
        and pools[ref["name"]]["spec"]["selector"]["matchLabels"].items() <= labels.items()
    ]
    (route,) = routes
    assert urlsplit(url).hostname in {ref["name"] for ref in route["spec"]["parentRefs"]}
    matches = [m for rule in route["spec"]["rules"] for m in rule["matches"]]
    assert {"path": {"type": "Exact", "value": GENERATE_ROUTE}, "method": "POST"} in matches
    (ref,) = [ref for rule in route["spec"]["rules"] for ref in rule["backendRefs"]]
    (port,) = pools[ref["name"]]["spec"]["targetPorts"]
    assert port["number"] == listen_port(container, ["engine"])


def test_gateway_mounts_what_the_models_file_names() -> None:
    docs = [d for _, d in resources()]
    models, gateway = models_file(docs)
    mounts = [Path(m["mountPath"]) for m in gateway["volumeMounts"]]
    for entry in models.models:
        # The gateway reads each model's tokenizer and config from its path.
        assert any(entry.path.is_relative_to(m) for m in mounts), entry.path
    store = flags(container_args(gateway))["--adapter-store"]
    assert Path(store or "") in mounts
