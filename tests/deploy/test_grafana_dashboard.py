"""deploy/grafana/loragate.json: a well-formed Grafana dashboard (ids, datasources, targets,
layout, template variables), and every series its PromQL queries is one a real `loragate serve`
exposes on /metrics, by the exact name Prometheus stores (counters with `_total`, histograms
as `_bucket` / `_sum` / `_count`), with the labels the queries match and group by.

Every `loragate:` series comes from the gateway's /metrics (gateway/metrics.py). A
`loragate engine` serves the same engine and per-request series on its own /metrics
(gateway/engine_service/app.py builds the same `Metrics`) but no tenant, limiter or usage-ledger
ones; the dashboard is for gateways, so the gateway is what is scraped here. The server runs
the demo model scaled to zero, so that its first request is a cold start (the cold-start
histogram has samples only once one happened), for a tenant limited to one request a minute,
so that the second is a 429 (the refusal counters have samples only once one happened).
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.servers import LORAGATE_CLI, spawn, stop, wait_ready
from gateway.settings import Settings
from gateway.tenancy.admin_auth import mint_admin_token

sys.path.insert(0, str(Path(__file__).parents[1] / "gateway"))  # live_server lives there
from live_server import TEST_SECRET, free_port  # noqa: E402

DASHBOARD = Path(__file__).parents[2] / "deploy" / "grafana" / "loragate.json"
DATASOURCE = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
# Grafana's own variables, which a dashboard uses without defining them.
GRAFANA_VARIABLES = {"__rate_interval", "__interval", "__range", "__all", "__from", "__to"}
# Labels Prometheus adds to every series it scrapes (the target's), absent from /metrics.
TARGET_LABELS = {"instance", "job"}


# -- the dashboard, read -------------------------------------------------------------------------


def _load() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def _panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, rows included, and the panels of collapsed rows."""
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def _queries(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, PromQL) of every panel target and every query variable."""
    for panel in _panels(dashboard):
        for target in panel.get("targets", []):
            yield f"panel {panel['id']} {panel['title']!r} {target['refId']}", target["expr"]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            yield f"variable {variable['name']}", variable["definition"]


def _strings(node: Any) -> Iterator[str]:
    if isinstance(node, str):
        yield node
    elif isinstance(node, dict):
        for value in node.values():
            yield from _strings(value)
    elif isinstance(node, list):
        for value in node:
            yield from _strings(value)


# -- PromQL, tokenized as far as the checks need -------------------------------------------------

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_IDENTIFIER = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_SELECTOR = re.compile(r"(loragate:[A-Za-z0-9_:]+)\s*\{([^}]*)\}")
_MATCHER = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)")
_GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
_LABEL_VALUES = re.compile(r"label_values\(\s*(loragate:[A-Za-z0-9_:]+)\s*,\s*(\w+)\s*\)")
_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)|\[\[(\w+)\]\]")


def metric_names(expr: str) -> set[str]:
    """The `loragate:` series an expression reads (string literals, such as label values and
    variables inside them, left out)."""
    return {name for name in _IDENTIFIER.findall(_STRING.sub('""', expr)) if "loragate:" in name}


def matched_labels(expr: str) -> Iterator[tuple[str, str]]:
    """(series, label) of every label matcher `series{label=...}` and `label_values(series,
    label)`."""
    bare = _STRING.sub('""', expr)
    for series, matchers in _SELECTOR.findall(bare):
        for label in _MATCHER.findall(matchers):
            yield series, label
    yield from _LABEL_VALUES.findall(bare)


def grouping_labels(expr: str) -> set[str]:
    """Labels of every `by (...)` / `without (...)`."""
    return {
        label.strip()
        for group in _GROUPING.findall(_STRING.sub('""', expr))
        for label in group.split(",")
        if label.strip()
    }


def variables(text: str) -> set[str]:
    return {next(g for g in match if g) for match in _VARIABLE.findall(text)}


def test_the_tokenizer_reads_series_labels_and_variables() -> None:
    expr = (
        "histogram_quantile(0.95, sum by (le, model) (rate(loragate:engine_cold_start_seconds_"
        'bucket{model=~"$model", x!="loragate:not_a_series"}[$__rate_interval])))'
        " / on() sum(loragate:usage_rows_pending)"
    )
    assert metric_names(expr) == {
        "loragate:engine_cold_start_seconds_bucket",
        "loragate:usage_rows_pending",
    }
    assert set(matched_labels(expr)) == {
        ("loragate:engine_cold_start_seconds_bucket", "model"),
        ("loragate:engine_cold_start_seconds_bucket", "x"),
    }
    assert grouping_labels(expr) == {"le", "model"}
    assert variables(expr + " ${DS_PROMETHEUS} [[tenant]] ${model:regex}") == {
        "model",
        "__rate_interval",
        "DS_PROMETHEUS",
        "tenant",
    }
    assert set(matched_labels("label_values(loragate:tenant_tokens_total, tenant)")) == {
        ("loragate:tenant_tokens_total", "tenant")
    }


# -- the dashboard's shape -----------------------------------------------------------------------


def test_the_dashboard_is_well_formed() -> None:
    dashboard = _load()
    assert dashboard["schemaVersion"] >= 36
    assert dashboard["uid"] and dashboard["title"]
    panels = list(_panels(dashboard))
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    assert all(isinstance(i, int) for i in ids)

    graphs = [panel for panel in panels if panel["type"] != "row"]
    assert len(graphs) >= 20
    for panel in graphs:
        where = f"panel {panel['id']} {panel['title']!r}"
        assert panel["datasource"] == DATASOURCE, where
        assert panel["targets"], f"{where} has no target"
        ref_ids = [target["refId"] for target in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), f"{where}: refIds repeat"
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE, where
            assert target["expr"].strip(), f"{where} {target['refId']} has no expression"
            assert metric_names(target["expr"]), f"{where} {target['refId']} reads no series"
            # Every series read carries the gateway selector.
            selectors = _SELECTOR.findall(target["expr"])
            read = _IDENTIFIER.findall(_STRING.sub('""', target["expr"]))
            assert len(selectors) == sum("loragate:" in name for name in read), where
            for series, matchers in selectors:
                assert 'instance=~"$gateway"' in matchers, f"{where}: {series} not by gateway"


def test_no_two_panels_overlap_and_all_fit_the_grid() -> None:
    boxes = [(p["id"], p["gridPos"]) for p in _load()["panels"]]
    for panel_id, box in boxes:
        assert box["x"] >= 0 and box["x"] + box["w"] <= 24, f"panel {panel_id} leaves the grid"
    for i, (a_id, a) in enumerate(boxes):
        for b_id, b in boxes[i + 1 :]:
            apart = (
                a["x"] + a["w"] <= b["x"]
                or b["x"] + b["w"] <= a["x"]
                or a["y"] + a["h"] <= b["y"]
                or b["y"] + b["h"] <= a["y"]
            )
            assert apart, f"panels {a_id} and {b_id} overlap"


def test_every_variable_used_is_defined_and_every_one_defined_is_used() -> None:
    dashboard = _load()
    defined = {variable["name"]: variable for variable in dashboard["templating"]["list"]}
    assert defined["DS_PROMETHEUS"]["type"] == "datasource"
    assert defined["DS_PROMETHEUS"]["query"] == "prometheus"
    assert (
        defined["model"]["definition"] == "label_values(loragate:num_requests_running, model_name)"
    )
    assert defined["tenant"]["definition"] == "label_values(loragate:tenant_tokens_total, tenant)"
    # Gateways are the instances with a usage ledger; All lists them (no allValue `.*`), so a
    # `loragate engine` scraped too, with engine and per-request series of its own, is never
    # counted with them.
    assert defined["gateway"]["definition"] == "label_values(loragate:usage_rows_pending, instance)"
    assert "allValue" not in defined["gateway"]
    for name in ("gateway", "model", "tenant"):
        assert defined[name]["datasource"] == DATASOURCE

    used = {name for text in _strings(dashboard["panels"]) for name in variables(text)}
    assert used - GRAFANA_VARIABLES <= set(defined), used - GRAFANA_VARIABLES - set(defined)
    assert set(defined) <= used, f"defined, never used: {set(defined) - used}"


# -- the series, on a real server ----------------------------------------------------------------


def _models_file(tmp_path: Path, demo_model_dir: Path) -> Path:
    path = tmp_path / "models.yaml"
    path.write_text(
        "models:\n"
        "  - name: demo\n"
        f"    path: {demo_model_dir}\n"
        "    min_replicas: 0\n"  # its first request starts its engine: a cold start
        "    engine: {kv_cache_memory: 64MiB, max_model_len: 256}\n"
    )
    return path


@pytest.fixture
def served_metrics(demo_model_dir: Path, tmp_path: Path) -> str:
    """/metrics of a `loragate serve` that answered one completion and refused one request
    with a 429."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    command = [
        LORAGATE_CLI, "serve",
        "--models-config", str(_models_file(tmp_path, demo_model_dir)),
        "--port", str(port),
        "--secret-key", TEST_SECRET,
        "--database-url", f"sqlite+aiosqlite:///{tmp_path / 'loragate.db'}",
        "--adapter-store", str(tmp_path / "adapters"),
        "--no-demo-tenant",
        "--spare-engines", "0",
        "--no-cpu-kernels",  # torch's ops: nothing to compile on a first run
        "--cold-start-timeout", "300",  # a busy CI machine
    ]  # fmt: skip
    server = spawn(command, log)
    try:
        wait_ready(url, server, log, path="/metrics")
        admin = {
            "Authorization": f"Bearer {mint_admin_token(Settings(secret_key=TEST_SECRET), 600)}"
        }
        tenant = httpx.post(
            f"{url}/admin/tenants", json={"name": "grafana", "rpm_limit": 1}, headers=admin
        )
        assert tenant.status_code == 201, tenant.text
        key = httpx.post(f"{url}/admin/tenants/{tenant.json()['id']}/keys", json={}, headers=admin)
        assert key.status_code == 201, key.text
        auth = {"Authorization": f"Bearer {key.json()['key']}"}

        body = {"model": "demo", "prompt": "Hello", "max_tokens": 4, "temperature": 0}
        done = httpx.post(f"{url}/v1/completions", json=body, headers=auth, timeout=120)
        assert done.status_code == 200, done.text
        refused = httpx.post(f"{url}/v1/completions", json=body, headers=auth, timeout=30)
        assert refused.status_code == 429, refused.text
        return httpx.get(f"{url}/metrics").text
    except BaseException:
        print(log.read_text(errors="replace")[-4000:])
        raise
    finally:
        stop(server)


def test_every_series_the_dashboard_queries_is_served(served_metrics: str) -> None:
    # sample name -> the labels its samples carry
    samples: dict[str, set[str]] = {}
    families: dict[str, str] = {}  # sample name -> "family (type)", for the messages
    for family in text_string_to_metric_families(served_metrics):
        for sample in family.samples:
            samples.setdefault(sample.name, set()).update(sample.labels)
            families[sample.name] = f"{family.name} ({family.type})"

    queries = list(_queries(_load()))
    missing = [
        f"{where}: {name}"
        for where, expr in queries
        for name in sorted(metric_names(expr))
        if name not in samples
    ]
    assert not missing, "queried, not served:\n" + "\n".join(missing)

    unlabeled = [
        f"{where}: {series} has no label {label!r}"
        for where, expr in queries
        for series, label in matched_labels(expr)
        if label not in samples[series] | TARGET_LABELS
    ]
    for where, expr in queries:
        labels = set().union(*(samples[name] for name in metric_names(expr))) | TARGET_LABELS
        unlabeled += [f"{where}: grouped by {label!r}" for label in grouping_labels(expr) - labels]
    assert not unlabeled, "\n".join(unlabeled)

    # Every family the dashboard reads, listed when it runs with -s; the panels cover each.
    read = {families[name] for _, expr in queries for name in metric_names(expr)}
    print("\n".join(sorted(read)))
    assert len(read) >= 25
