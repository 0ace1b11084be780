"""Adapters replaced and deleted under load, through HTTP against `loragate serve` of the demo
model (issue 40): a stream keeps the weights it started with to its last token, a request
that starts after a replacement gets the new weights (never a prefix-cache block computed
with the old ones), a deleted adapter's running streams finish and new requests get a 404;
and two hundred adapters of twenty tenants cycle through sixteen slots, each request
answered by its own adapter."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from engine_services import metric_sum
from hf_reference import peft_greedy  # tests/engine (pyproject.toml: pytest pythonpath)
from live_server import ServeProcess, admin_client, new_tenant, serve_process
from test_admin_adapters import upload
from transformers import AutoTokenizer

from adapters.demo import clone_adapter
from adapters.peft import describe_base
from adapters.registry import AdapterRegistry
from engine import LLM, SamplingParams
from engine.detokenizer import IncrementalDetokenizer

STREAMS = 16
STREAM_TOKENS = 128
# Every prompt starts with the same 96 tokens, six full blocks: a block computed under the old
# weights would serve the new weights' requests if the prefix cache keyed blocks by name.
_rng = random.Random(40)
PREFIX = [_rng.randrange(3, 8000) for _ in range(96)]
PROMPTS = [PREFIX + [_rng.randrange(3, 8000) for _ in range(8)] for _ in range(4)]


@pytest.fixture(scope="module")
def server(
    demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServeProcess]:
    """One `loragate serve` (engine process, float32) for the module: sixteen device slots,
    sixteen adapters in CPU memory, vLLM's runtime loading on."""
    flags = ["--dtype", "float32", "--max-loras", "16", "--max-cpu-loras", "16"]
    flags += ["--allow-runtime-lora-updating"]
    with serve_process(demo_model_dir, tmp_path_factory.mktemp("reupload"), *flags) as server:
        yield server


@pytest.fixture(scope="module")
def tokenizer(demo_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(demo_model_dir)


def detokenized(tokenizer: Any, prompt: list[int], token_ids: list[int]) -> str:
    """The text the server streams for these output tokens (its incremental detokenizer)."""
    detokenizer = IncrementalDetokenizer(tokenizer, prompt, [], skip_special_tokens=True)
    for token_id in token_ids:
        detokenizer.update(token_id)
    return detokenizer.text


def peft_texts(
    model_dir: Path, tokenizer: Any, adapter: Path, prompts: list[list[int]], max_tokens: int
) -> list[str]:
    outputs = peft_greedy(model_dir, adapter, prompts, max_tokens)
    return [detokenized(tokenizer, p, ids) for p, ids in zip(prompts, outputs, strict=True)]


def complete(server: ServeProcess, key: str, model: str, prompt: list[int], **body: Any) -> Any:
    resp = httpx.post(
        f"{server.url}/v1/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={"model": model, "prompt": prompt, "temperature": 0, "ignore_eos": True} | body,
        timeout=120,
    )
    assert resp.status_code == 200, resp.text
    return resp.json()


class Streams:
    """Streaming greedy completions, one thread each, the prompts taken in turn."""

    def __init__(self, server: ServeProcess, key: str, model: str, count: int) -> None:
        self.client = openai.OpenAI(
            base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=120
        )
        self.model = model
        self.prompts = [PROMPTS[i % len(PROMPTS)] for i in range(count)]
        self._started = threading.Condition()
        self._num_started = 0
        self._pool = ThreadPoolExecutor(count)
        self._futures = [self._pool.submit(self._read, p) for p in self.prompts]

    def _read(self, prompt: list[int]) -> tuple[str, str | None]:
        stream = self.client.completions.create(
            model=self.model,
            prompt=prompt,
            max_tokens=STREAM_TOKENS,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        text, finish_reason, first = "", None, True
        for chunk in stream:
            assert chunk.model == self.model
            for choice in chunk.choices:
                text += choice.text
                finish_reason = choice.finish_reason or finish_reason
            if first and chunk.choices:
                first = False
                with self._started:
                    self._num_started += 1
                    self._started.notify_all()
        return text, finish_reason

    def wait_started(self) -> None:
        """Until every stream has its first tokens (or one of them failed). A stream that
        already finished has started; the others may still be waiting for theirs (sixteen
        client threads on two cores), so an early finish is not a reason to stop waiting."""

        def failed(f: Future[tuple[str, str | None]]) -> bool:
            return f.done() and f.exception() is not None

        with self._started:
            started = self._started.wait_for(
                lambda: self._num_started == len(self._futures) or any(map(failed, self._futures)),
                timeout=120,
            )
        assert started and self._num_started == len(self._futures), self._num_started

    def results(self) -> list[tuple[str, str | None]]:
        try:
            return [f.result(timeout=120) for f in self._futures]
        finally:
            self._pool.shutdown()


class AdminUploads:
    """Adapters through the admin REST: a tenant's own, uploaded (multipart). A name in use is
    refused (409), so replacing is deleting the row and uploading anew."""

    def __init__(self, server: ServeProcess, tenant_id: str) -> None:
        self.server = server
        self.tenant_id = tenant_id
        self.ids: dict[str, str] = {}

    def register(self, name: str, path: Path) -> None:
        with admin_client(self.server) as admin:
            resp = upload(admin, path, name, self.tenant_id)
        assert resp.status_code == 201, resp.text
        self.ids[name] = resp.json()["id"]

    def replace(self, name: str, path: Path) -> None:
        with admin_client(self.server) as admin:
            taken = upload(admin, path, name, self.tenant_id)
            assert taken.status_code == 409, taken.text
            assert taken.json()["error"]["code"] == "adapter_exists"
        self.remove(name)
        self.register(name, path)

    def remove(self, name: str) -> None:
        with admin_client(self.server) as admin:
            resp = admin.delete(f"/admin/adapters/{self.ids.pop(name)}")
        assert resp.status_code == 204, resp.text


class RuntimeLoads:
    """vLLM's runtime routes: public adapters from server-local paths; loading a name in use
    moves it to the new files."""

    def __init__(self, server: ServeProcess) -> None:
        self.server = server

    def register(self, name: str, path: Path) -> None:
        with admin_client(self.server) as admin:
            resp = admin.post(
                "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)}
            )
        assert resp.status_code == 200, resp.text

    replace = register

    def remove(self, name: str) -> None:
        with admin_client(self.server) as admin:
            resp = admin.post("/v1/unload_lora_adapter", json={"lora_name": name})
        assert resp.status_code == 200, resp.text


# Per route, the adapters v1 and v2 are redrawn (clone_adapter) from these peft-built ones:
# another rank and other targets, and weights no other test of the server stores.
ROUTES = {"admin": ("r8-all", "r16-all", 1), "runtime": ("r4-attn", "r16-attn", 2)}


@pytest.mark.parametrize("route", list(ROUTES))
def test_streams_keep_their_weights_when_the_adapter_is_replaced_or_deleted(
    server: ServeProcess,
    demo_model_dir: Path,
    demo_adapters: dict[str, Path],
    tokenizer: Any,
    tmp_path: Path,
    route: str,
) -> None:
    old, new, seed = ROUTES[route]
    v1 = clone_adapter(demo_adapters[old], tmp_path / "v1", seed=4000 + seed)
    v2 = clone_adapter(demo_adapters[new], tmp_path / "v2", seed=4100 + seed)
    expected_v1 = peft_texts(demo_model_dir, tokenizer, v1, PROMPTS, STREAM_TOKENS)
    expected_v2 = peft_texts(demo_model_dir, tokenizer, v2, PROMPTS, STREAM_TOKENS)
    assert expected_v1 != expected_v2
    tenant_id, key = new_tenant(server, f"reupload-{route}")
    admin = AdminUploads(server, tenant_id) if route == "admin" else RuntimeLoads(server)
    admin.register("v", v1)

    # Replaced once sixteen streams have their first tokens: they finish with v1; what starts
    # after the replacement gets v2.
    before = Streams(server, key, "v", STREAMS)
    before.wait_started()
    admin.replace("v", v2)
    first = complete(server, key, "v", PROMPTS[0], max_tokens=STREAM_TOKENS)
    assert first["choices"][0]["text"] == expected_v2[0]
    # v1's streams computed these prompts' six prefix blocks (same tenant, same tokens): none
    # of them serves v2. The next request hits the blocks v2 computed.
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    again = complete(server, key, "v", PROMPTS[1], max_tokens=STREAM_TOKENS)
    assert again["choices"][0]["text"] == expected_v2[1]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == len(PREFIX)
    after = Streams(server, key, "v", STREAMS)
    assert before.results() == [(expected_v1[i % 4], "length") for i in range(STREAMS)]
    assert after.results() == [(expected_v2[i % 4], "length") for i in range(STREAMS)]

    # Deleted once sixteen streams have their first tokens: they finish; new requests get a 404.
    during = Streams(server, key, "v", STREAMS)
    during.wait_started()
    admin.remove("v")
    for stream in (False, True):
        gone = httpx.post(
            f"{server.url}/v1/completions",
            headers={"Authorization": f"Bearer {key}"},
            json={"model": "v", "prompt": PROMPTS[0], "max_tokens": 4, "stream": stream},
            timeout=60,
        )
        assert gone.status_code == 404, gone.text
        assert gone.json() == {
            "error": {
                "message": "The model `v` does not exist.",
                "type": "invalid_request_error",
                "param": "model",
                "code": "model_not_found",
            }
        }
    assert during.results() == [(expected_v2[i % 4], "length") for i in range(STREAMS)]


NUM_TENANTS = 20
PER_TENANT = 10
MANY_TOKENS = 8
REPLACED, DELETED = 37, 123  # tenant 3's `a7`, tenant 12's `a3`


def test_two_hundred_adapters_of_twenty_tenants_cycle_through_sixteen_slots(
    server: ServeProcess,
    demo_model_dir: Path,
    demo_adapters: dict[str, Path],
    tokenizer: Any,
    tmp_path: Path,
) -> None:
    # The five peft-built adapters (ranks 4 to 16, attention or all projections) redrawn forty
    # times each: adapter k is tenant k // 10's `a{k % 10}`, so every tenant has the same names.
    sources = list(demo_adapters.values())
    count = NUM_TENANTS * PER_TENANT
    paths = [clone_adapter(sources[k % 5], tmp_path / f"a{k}", seed=5000 + k) for k in range(count)]
    replacement = clone_adapter(sources[REPLACED % 5], tmp_path / "replacement", seed=6000)
    tenants = [new_tenant(server, f"many-{t}") for t in range(NUM_TENANTS)]
    uploads = [AdminUploads(server, tenant_id) for tenant_id, _ in tenants]
    for k, path in enumerate(paths):
        uploads[k // PER_TENANT].register(f"a{k % PER_TENANT}", path)
    # A tenant's prompts share a prefix (under its own cache salt); each adapter has its tail.
    rng = random.Random(41)
    prefixes = [[rng.randrange(3, 8000) for _ in range(32)] for _ in range(NUM_TENANTS)]
    prompts = [
        prefixes[k // PER_TENANT] + [rng.randrange(3, 8000) for _ in range(4)] for k in range(count)
    ]

    # The reference: the offline engine (tests/engine/lora/test_lora_vs_peft.py holds it to peft),
    # and peft itself for one adapter of each configuration and the replacement.
    registry = AdapterRegistry(describe_base(demo_model_dir), max_lora_rank=16)
    loras = [registry.register(f"a{k}", path) for k, path in enumerate([*paths, replacement])]
    llm = LLM(
        str(demo_model_dir),
        lora_loader=registry.load,
        dtype="float32",
        kv_cache_memory=32 << 20,
        max_model_len=256,
        max_loras=16,
        num_threads=1,  # as the server's engine on two cores: every core but one
    )
    params = SamplingParams(max_tokens=MANY_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = llm.generate([*prompts, prompts[REPLACED]], params, lora_request=loras)
    expected = [output.outputs[0].text for output in outputs]
    checked = [(k, paths[k], prompts[k]) for k in range(5)]
    for k, path, prompt in [*checked, (count, replacement, prompts[REPLACED])]:
        assert peft_texts(demo_model_dir, tokenizer, path, [prompt], MANY_TOKENS) == [expected[k]]
    assert expected[REPLACED] != expected[count]

    def ask(k: int) -> str:
        key = tenants[k // PER_TENANT][1]
        answer = complete(server, key, f"a{k % PER_TENANT}", prompts[k], max_tokens=MANY_TOKENS)
        return str(answer["choices"][0]["text"])

    loads_before = metric_sum(httpx.get(f"{server.url}/metrics").text, "loragate:lora_loads_total")
    order = [k for k in range(count) if k not in (REPLACED, DELETED)]
    rng.shuffle(order)
    with ThreadPoolExecutor(32) as pool:
        first: dict[int, Future[str]] = {
            k: pool.submit(ask, k) for k in [REPLACED, DELETED, *order[:100]]
        }
        # Replaced and deleted once they have answered, while the rest of the first hundred run.
        first[REPLACED].result()
        first[DELETED].result()
        uploads[REPLACED // PER_TENANT].replace(f"a{REPLACED % PER_TENANT}", replacement)
        uploads[DELETED // PER_TENANT].remove(f"a{DELETED % PER_TENANT}")
        second = {k: pool.submit(ask, k) for k in order[100:]}
        replaced = pool.submit(ask, REPLACED)
    assert {k: f.result() for k, f in first.items()} == {k: expected[k] for k in first}
    assert {k: f.result() for k, f in second.items()} == {k: expected[k] for k in second}
    assert replaced.result() == expected[count]
    deleted = httpx.post(
        f"{server.url}/v1/completions",
        headers={"Authorization": f"Bearer {tenants[DELETED // PER_TENANT][1]}"},
        json={"model": f"a{DELETED % PER_TENANT}", "prompt": prompts[DELETED], "max_tokens": 2},
        timeout=60,
    )
    assert deleted.status_code == 404 and deleted.json()["error"]["code"] == "model_not_found"
    # Every adapter went through one of the sixteen slots (some more than once).
    metrics = httpx.get(f"{server.url}/metrics").text
    assert metric_sum(metrics, "loragate:lora_loads_total") - loads_before >= count + 1
