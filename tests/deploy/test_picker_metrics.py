"""A `loragate engine` pod as a Gateway API Inference Extension pool's endpoint picker sees it.

The picker (deploy/k8s/base/inference/picker-config.yaml) reads five series from each pod's
/metrics, under the names its engine config gives them. A real `loragate engine` with one LoRA
slot runs one adapter's long requests while another adapter's request waits for the slot; its
/metrics, scraped then and parsed as Prometheus text, hold every series the config names, with
the labels the picker parses and the engine's own values. The manifests are checked against
each other: the route reaches the pool, the pool its picker, the picker its config.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from adapters.peft import adapter_identity
from adapters.store import open_adapter_store

sys.path.insert(0, str(Path(__file__).parents[1] / "gateway"))  # the engine helpers live there
from engine_services import (  # noqa: E402
    ENGINE_KNOBS,
    LORAGATE_CLI,
    TOKEN,
    EngineService,
    wait_healthy,
)
from live_server import free_port  # noqa: E402

INFERENCE = Path(__file__).parents[2] / "deploy" / "k8s" / "base" / "inference"
BLOCK_SIZE = 16
# What the picker parses of each spec's series (pkg/epp/datalayer/metrics: the value of the
# three gauges; the labels of the two info series).
SPEC_LABELS = {
    "queuedRequestsSpec": (),
    "runningRequestsSpec": (),
    "kvUsageSpec": (),
    "loraSpec": ("max_lora", "running_lora_adapters", "waiting_lora_adapters"),
    "cacheInfoSpec": ("block_size", "num_gpu_blocks"),
}
# A spec is a PromQL instant vector selector: name{label="value",...}.
_SPEC = re.compile(r"(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?")
_MATCHER = re.compile(r'\s*(\w+)\s*=\s*"?([^",}]*)"?\s*')


def _manifests(name: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all((INFERENCE / name).read_text()) if doc]


def _picker_config() -> dict[str, Any]:
    (config_map,) = _manifests("picker-config.yaml")
    (text,) = config_map["data"].values()
    config: dict[str, Any] = yaml.safe_load(text)
    return config


def _engine_config() -> dict[str, str]:
    """The engine config loragate's pods get: the picker's default engine's specs."""
    (extractor,) = [
        p for p in _picker_config()["plugins"] if p["type"] == "model-server-protocol-metrics"
    ]
    parameters = extractor["parameters"]
    (engine,) = [e for e in parameters["engineConfigs"] if e["name"] == "loragate"]
    assert parameters["defaultEngine"] == "loragate"
    return {key: value for key, value in engine.items() if key != "name"}


# -- the engine --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(
    demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EngineService]:
    """A `loragate engine` of the demo model with LoRA and one slot (`--max-loras 1`)."""
    root = tmp_path_factory.mktemp("picker")
    port, log = free_port(), root / "engine.log"
    command = [LORAGATE_CLI, "engine", "--model", str(demo_model_dir), "--port", str(port)]
    command += ["--served-model-name", "demo", "--engine-token", TOKEN]
    command += ["--adapter-store", str(root / "adapters"), "--max-loras", "1"]
    # The demo model's whole context: story-a's requests run long enough that story-b is
    # seen waiting behind them on a slow machine too.
    command += ["--block-size", str(BLOCK_SIZE), *ENGINE_KNOBS, "--max-model-len", "2048"]
    with log.open("wb") as out:
        # Wide enough that the log's lines are not wrapped (the KV cache's is read back).
        env = os.environ | {"COLUMNS": "400"}
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env
        )
    started = EngineService(f"http://127.0.0.1:{port}", process, log)
    try:
        wait_healthy(started, timeout=300)  # a busy machine
        yield started
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(30)


def _scrape(engine: EngineService) -> dict[str, Metric]:
    text = httpx.get(f"{engine.url}/metrics", timeout=5).text
    return {family.name: family for family in text_string_to_metric_families(text)}


def _lora_lists(families: dict[str, Metric], spec: str) -> tuple[set[str], set[str]]:
    """(running, waiting) adapter names of the newest series, as the picker picks it."""
    newest = max(families[spec].samples, key=lambda s: s.value)
    running, waiting = (
        newest.labels[k] for k in ("running_lora_adapters", "waiting_lora_adapters")
    )
    return set(filter(None, running.split(","))), set(filter(None, waiting.split(",")))


def _complete(engine: EngineService, model: str, adapter: str, max_tokens: int) -> None:
    """An OpenAI request as a router sends one for a tenant's adapter: its `model` is the name
    the picker matches, the sha256 in the header is what the engine loads."""
    headers = {"Authorization": f"Bearer {TOKEN}", "X-Loragate-Adapter": adapter}
    body = {
        "model": model,
        "prompt": f"{model} tells a long story:",
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    answer = httpx.post(f"{engine.url}/v1/completions", json=body, headers=headers, timeout=300)
    assert answer.status_code == 200, answer.text


def _selector(spec: str) -> tuple[str, dict[str, str]]:
    """A spec's metric name and label matchers."""
    match = _SPEC.fullmatch(spec)
    assert match is not None, f"{spec!r} is not a metric selector"
    return match["name"], dict(_MATCHER.findall(match["labels"] or ""))


def test_the_engine_exports_every_series_the_picker_config_names(
    engine: EngineService, demo_adapters: dict[str, Path]
) -> None:
    selectors = {key: _selector(spec) for key, spec in _engine_config().items()}
    assert set(selectors) == set(SPEC_LABELS)
    names = {key: name for key, (name, _) in selectors.items()}
    store = open_adapter_store(engine.log.parent / "adapters")
    token = {"Authorization": f"Bearer {TOKEN}"}
    adapters = {}  # the name a request's `model` gives -> sha256
    for model, source in (
        ("story-a", demo_adapters["r8-attn"]),
        ("story-b", demo_adapters["r16-all"]),
    ):
        sha256 = adapter_identity(source)
        store.copy_in(source, sha256)
        loaded = httpx.put(f"{engine.url}/internal/v1/adapters/{sha256}", headers=token)
        assert loaded.status_code == 202, loaded.text
        adapters[model] = sha256

    # story-a's requests hold the one slot; story-b's waits for it to drain.
    threads = [
        threading.Thread(target=_complete, args=(engine, "story-a", adapters["story-a"], 1900))
        for _ in range(2)
    ]
    for thread in threads:
        thread.start()
    _wait_for(engine, lambda f: _lora_lists(f, names["loraSpec"])[0] == {"story-a"})
    waiter = threading.Thread(target=_complete, args=(engine, "story-b", adapters["story-b"], 4))
    waiter.start()
    threads.append(waiter)
    try:
        families = _wait_for(
            engine, lambda f: _lora_lists(f, names["loraSpec"]) == ({"story-a"}, {"story-b"})
        )
    finally:
        for thread in threads:
            thread.join(300)

    for key, (name, matchers) in selectors.items():
        assert name in families, f"{key} names {name}, which the engine does not export"
        family = families[name]
        assert family.type == "gauge", f"{name}: the picker reads a gauge's value"
        samples = [s for s in family.samples if matchers.items() <= s.labels.items()]
        assert samples, f"no {name} series matches {matchers}"
        for label in SPEC_LABELS[key]:
            assert all(label in s.labels for s in samples), f"{name} lacks the label {label}"

    def value(key: str) -> float:
        (sample,) = families[names[key]].samples
        return float(sample.value)

    assert value("runningRequestsSpec") >= 1  # story-a's
    assert value("queuedRequestsSpec") == 1  # story-b's
    assert 0 < value("kvUsageSpec") <= 1  # a fraction, as vLLM's: 1 is every block in use

    (info,) = families[names["loraSpec"]].samples
    assert info.labels["max_lora"] == "1"
    assert abs(info.value - time.time()) < 60  # the picker keeps the series with the newest time

    (cache,) = families[names["cacheInfoSpec"]].samples
    assert cache.value == 1.0
    # The engine gives its pool's shape in its start-up log: "KV cache: N blocks x B tokens".
    shape = re.search(r"KV cache: (\d+) blocks x (\d+) tokens", engine.log.read_text())
    assert shape is not None, engine.log.read_text()
    assert cache.labels["num_gpu_blocks"] == shape[1]
    assert cache.labels["block_size"] == shape[2] == str(BLOCK_SIZE)

    # Both done: no adapter has a request running or waiting.
    after = _wait_for(engine, lambda f: _lora_lists(f, names["loraSpec"]) == (set(), set()))
    assert after[names["runningRequestsSpec"]].samples[0].value == 0


def _wait_for(engine: EngineService, condition: Any, timeout: float = 120.0) -> dict[str, Metric]:
    """Scrape until `condition(families)` holds; those families."""
    deadline = time.monotonic() + timeout
    while True:
        families = _scrape(engine)
        if condition(families):
            return families
        assert engine.process.poll() is None, engine.log.read_text()
        assert time.monotonic() < deadline, f"never held; last scrape: {families.keys()}"
        time.sleep(0.02)


# -- the manifests -----------------------------------------------------------------------------


def test_the_route_reaches_the_pool_and_the_pool_its_picker() -> None:
    (kustomization,) = _manifests("kustomization.yaml")
    listed = set(kustomization["resources"])
    assert listed == {p.name for p in INFERENCE.glob("*.yaml")} - {"kustomization.yaml"}

    (route,) = _manifests("httproute.yaml")
    (pool,) = _manifests("inferencepool.yaml")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    (rule,) = route["spec"]["rules"]
    (backend,) = rule["backendRefs"]
    assert (backend["group"], backend["kind"]) == ("inference.networking.k8s.io", "InferencePool")
    assert backend["name"] == pool["metadata"]["name"]

    picker = {doc["kind"]: doc for doc in _manifests("picker.yaml")}
    service, deployment = picker["Service"], picker["Deployment"]
    ref = pool["spec"]["endpointPickerRef"]
    assert ref["name"] == service["metadata"]["name"]
    assert ref["port"]["number"] in {p["port"] for p in service["spec"]["ports"]}
    pod = deployment["spec"]["template"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert (
        deployment["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    )
    assert pod["spec"]["serviceAccountName"] == picker["ServiceAccount"]["metadata"]["name"]

    (container,) = pod["spec"]["containers"]
    assert re.fullmatch(
        r"registry\.k8s\.io/gateway-api-inference-extension/epp:v[\d.]+", container["image"]
    )
    args = container["args"]
    assert args[args.index("--pool-name") + 1] == pool["metadata"]["name"]
    config_file = Path(args[args.index("--config-file") + 1])
    (mount,) = container["volumeMounts"]
    assert config_file.parent == Path(mount["mountPath"])
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == mount["name"]]
    (config_map,) = _manifests("picker-config.yaml")
    assert volume["configMap"]["name"] == config_map["metadata"]["name"]
    assert config_file.name in config_map["data"]

    config = _picker_config()
    assert (config["apiVersion"], config["kind"]) == (
        "inference.networking.x-k8s.io/v1alpha1",
        "EndpointPickerConfig",
    )
    names = {p.get("name", p["type"]) for p in config["plugins"]}
    refs = {r["pluginRef"] for profile in config["schedulingProfiles"] for r in profile["plugins"]}
    for source in config["data"]["sources"]:
        refs |= {source["pluginRef"], *(e["pluginRef"] for e in source["extractors"])}
    assert refs <= names, f"references to no plugin: {refs - names}"
