"""The map's arrows (../shared/DESIGN.md), checked on the code: no import cycle among the
product's modules (imports under TYPE_CHECKING and inside functions included), the engine
imports nothing of the gateway, tenants or adapters, kernels nothing but itself, and the product
nothing of bench/."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("engine", "kernels", "adapters", "tenants", "gateway")


def _modules() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            modules[name.removesuffix(".__init__")] = path
    return modules


def _imports(path: Path) -> set[str]:
    """Every absolute module name `path` imports, wherever the import stands."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def _graph() -> dict[str, set[str]]:
    """module -> the product's modules it imports (a package's own submodules importing the
    package itself do not count: that is how a package re-exports)."""
    modules = _modules()
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        for target in _imports(path):
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name and not name.startswith(target + "."):
                graph[name].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in list(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycles() -> None:
    assert _cycles(_graph()) == []


def test_the_cycle_finder_finds_one() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_arrows_point_down() -> None:
    for name, path in _modules().items():
        top = {target.split(".")[0] for target in _imports(path)}
        if name.startswith("engine"):
            assert not top & {"gateway", "tenants", "adapters", "bench"}, name
        if name.startswith("kernels"):
            assert not top & {"engine", "gateway", "tenants", "adapters", "bench"}, name
        assert "bench" not in top, name


def test_each_side_of_the_engine_loop_imports_only_its_own() -> None:
    """The engine process runs the loop's body and serves no client; the gateway's clients
    share the client's side; the thread backend is one more client, used by neither."""
    graph = _graph()
    assert "engine.frontend.async_engine" not in graph["engine.frontend.engine_main"]
    assert "engine.frontend.async_engine" not in graph["engine.frontend.engine_process"]
    assert "engine.frontend.client" not in graph["engine.frontend.engine_main"]
    assert "engine.frontend.loop" in graph["engine.frontend.engine_main"]


def test_the_engine_core_never_imports_its_front_ends() -> None:
    """engine/frontend/ (the clients, the loop in a thread or a process, warm spares, the zygote,
    offline) drives the engine core; the core (LLMEngine, scheduler, model runner, KV cache,
    models, LoRA, checkpoints, ...) never imports it. Outside the front ends only the package's
    re-export (`engine.LLM`) and engine.messages (the engine process's Ready carries the
    `EngineFacts`) name a module of it. engine/lora/ and engine/checkpoints/ sit below the core:
    they import none of LLMEngine, the scheduler or the model runner."""
    graph = _graph()
    allowed = {"engine": {"engine.frontend.offline"}, "engine.messages": {"engine.frontend.facts"}}
    for name, targets in graph.items():
        if name.startswith("engine") and not name.startswith("engine.frontend"):
            front = {t for t in targets if t.split(".")[:2] == ["engine", "frontend"]}
            assert front <= allowed.get(name, set()), (name, front)
        if name.startswith(("engine.lora", "engine.checkpoints")):
            core = {"engine.llm_engine", "engine.scheduler", "engine.model_runner"}
            assert not targets & core, name
    assert "engine.llm_engine" in graph["engine.frontend.async_engine"]
    assert "engine.llm_engine" in graph["engine.frontend.engine_main"]


def test_the_gateways_packages_point_one_way() -> None:
    """The OpenAI API never imports the routes that mount it; the models served never import
    the API; `loragate engine`'s service serves the API's core, never the gateway's routes."""
    for name, targets in _graph().items():
        if name.startswith("gateway.openai"):
            assert not {t for t in targets if t.startswith("gateway.routers")}, name
        if name.startswith("gateway.models"):
            assert not {t for t in targets if t.startswith("gateway.openai")}, name
        if name.startswith("gateway.engine_service"):
            assert not {t for t in targets if t.startswith("gateway.routers")}, name
        if name.startswith("gateway.remote"):
            assert not {
                t for t in targets if t.startswith(("gateway.openai", "gateway.routers"))
            }, name


def test_the_endpoints_stand_on_the_openai_core_not_on_each_other() -> None:
    """Chat and completions each build on the shared core (gateway/openai/serving.py) and never
    on each other; the core and the responders below it (answer, JSON, SSE) ask an endpoint's
    form and import neither endpoint; `loragate engine`'s service builds the core."""
    graph = _graph()
    endpoints = {"gateway.openai.chat", "gateway.openai.completions"}
    for endpoint in endpoints:
        assert "gateway.openai.serving" in graph[endpoint], endpoint
        assert not graph[endpoint] & (endpoints - {endpoint}), endpoint
    below = ("serving", "answer", "json_response", "sse", "streaming", "output_checks")
    for name in below:
        assert not graph[f"gateway.openai.{name}"] & endpoints, name
    assert "gateway.openai.serving" in graph["gateway.engine_service.openai"]
