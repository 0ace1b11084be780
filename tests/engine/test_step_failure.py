"""A request that makes a step fail fails alone: the others finish with the tokens of a
clean run, and no KV block leaks. Offline here; both server loops in test_engine_process
and test_async_engine."""

from __future__ import annotations

from pathlib import Path

import pytest
from poison import GREEDY, SHARED, Poison, PoisonedParams, poisoned, victims

from engine import LLM
from engine.kv_cache.manager import KVCacheManager
from engine.request import Request
from engine.step_failure import isolate_failures


@pytest.fixture(scope="module")
def llm(demo_model_dir: Path) -> LLM:
    return LLM(str(demo_model_dir), kv_cache_memory=32 << 20, max_model_len=256, dtype="float32")


def _run(llm: LLM, poison_at: int | None, fail_from: int = 1) -> list[tuple[list[int], str]]:
    requests = victims()
    if poison_at is not None:
        requests.insert(poison_at, poisoned(fail_from))
    prompts = [p for p, _ in requests]
    params = [s for _, s in requests]
    outs = llm.generate(prompts, params)
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason or "") for o in outs]


@pytest.mark.parametrize("fail_from", [1, 4], ids=["in-its-prefill", "mid-decode"])
def test_a_poisoned_request_fails_alone(llm: LLM, fail_from: int) -> None:
    clean = _run(llm, None)
    llm.engine.kv.reset_prefix_cache()  # the poisoned run starts as cold as the clean one
    got = _run(llm, poison_at=6, fail_from=fail_from)
    tokens, finish_reason = got.pop(6)
    assert finish_reason == "error" and len(tokens) == fail_from - 1
    assert got == clean
    assert llm.engine.num_failed_requests >= 1
    kv = llm.engine.kv
    assert kv.num_free_blocks == kv.pool.num_blocks and not llm.engine.parents


MARKER = 4242


def test_a_forward_that_fails_leaves_no_garbage_for_same_step_sharers(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A forward that dies after writing garbage into its slots (here: whenever the marker
    token is among its inputs). The poisoned request publishes its prompt's full blocks when
    admitted; the requests admitted after it in the same step hit them. The failed step is
    rolled back, so they recompute instead of reading the garbage."""
    prompts = [SHARED + [MARKER]] + [SHARED + [20 + i, 30 + i] for i in range(4)] + [[9, 8, 7]]
    llm.engine.kv.reset_prefix_cache()
    clean = [o.outputs[0].token_ids for o in llm.generate(prompts[1:], GREEDY)]
    llm.engine.kv.reset_prefix_cache()
    model = llm.engine.runner.model
    forward = model.forward

    def failing_forward(ids, positions, plan, kv_caches, lora=None, give_way=None):  # type: ignore[no-untyped-def]
        if bool((ids == MARKER).any()):
            slots = plan.slot_mapping
            for k, v in kv_caches:
                for cache in (k, v):
                    cache.view(cache.shape[0], -1, cache.shape[-1])[:, slots] = 1e4
            raise Poison("the forward died half-way")
        return forward(ids, positions, plan, kv_caches, lora, give_way)

    monkeypatch.setattr(model, "forward", failing_forward)
    outs = llm.generate(prompts, GREEDY)
    assert outs[0].outputs[0].finish_reason == "error"
    assert [o.outputs[0].token_ids for o in outs[1:]] == clean
    kv = llm.engine.kv
    assert kv.num_free_blocks == kv.pool.num_blocks


def test_an_error_reaches_the_output(llm: LLM) -> None:
    poisoned = PoisonedParams(temperature=0, max_tokens=4)
    out = llm.generate([[5, 6, 7]], poisoned)[0]
    assert out.outputs[0].finish_reason == "error"
    assert out.error is not None and "Poison" in out.error


def _rows(n: int) -> list[tuple[Request, int]]:
    return [(Request(f"r{i}", [1, 2], GREEDY, None), 2) for i in range(n)]


def test_isolation_pins_every_culprit_with_its_own_error() -> None:
    rows = _rows(16)
    bad = {rows[3][0].request_id, rows[12][0].request_id}
    runs = []

    def run(part: list[tuple[Request, int]]) -> None:
        runs.append(len(part))
        for request, _ in part:
            if request.request_id in bad:
                raise ValueError(request.request_id)

    culprits = isolate_failures(rows, run, ValueError("whole"))
    assert [(r.request_id, str(e)) for r, e in culprits] == [("r3", "r3"), ("r12", "r12")]
    assert len(runs) <= 2 * 2 * 4  # two culprits: at most 2 * log2(16) runs each


def test_a_batch_that_fails_only_whole_has_no_culprit() -> None:
    def run(part: list[tuple[Request, int]]) -> None:
        if len(part) > 8:
            raise MemoryError

    assert isolate_failures(_rows(16), run, RuntimeError("whole")) == []


def test_roll_back_withdraws_the_steps_blocks_and_names_same_step_sharers() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_caching=True)
    first = Request("first", list(range(1, 11)), GREEDY, None)  # 2 full blocks + 2 tokens
    assert kv.allocate_slots(first, 10)
    sharer = Request("sharer", list(range(1, 9)) + [50, 51, 52], GREEDY, None)
    hits, num_hit = kv.get_computed_blocks(sharer)
    assert num_hit == 8  # hit the blocks `first` publishes in the same step
    assert kv.allocate_slots(sharer, 3, hits)
    sharer.num_computed_tokens = num_hit
    dependents = kv.roll_back_step([(first, 10), (sharer, 3)])
    assert dependents == [sharer]
    again = Request("again", list(range(1, 9)) + [60], GREEDY, None)
    assert kv.get_computed_blocks(again) == ([], 0)  # nothing of the failed step is cached
    kv.free(sharer)
    assert kv.allocate_slots(first, 10)  # recomputing publishes the blocks again
    assert kv.get_computed_blocks(again)[1] == 8
