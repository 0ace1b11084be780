"""The served OpenAPI schema tells the truth: schemathesis generates requests for every
operation (tenant routes with a tenant's key, admin routes with an admin token) and checks
each answer against the schema: status codes, content types, bodies, headers, and no 5xx."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from live_server import ServerTenancy, build_test_app, lora_engine
from schemathesis import Case, CheckContext, GenerationMode, Response
from schemathesis.schemas import APIOperation, BaseSchema

# Imported at collection, not by the fixture's first schema load: CPython 3.11's ast.parse keeps
# one recursion counter per interpreter, and pytest's rewrite of these modules, run while an
# engine thread also parses, failed a CI with "AST constructor recursion depth mismatch"
# (cpython#106905).
from schemathesis.specs.openapi import adapter  # noqa: F401
from schemathesis.specs.openapi.checks import negative_data_rejection, positive_data_acceptance

MODEL = "demo"
EXAMPLES = int(os.environ.get("LORAGATE_OPENAPI_EXAMPLES", "30"))
ADMIN_PATHS = ("/admin", "/v1/load_lora_adapter", "/v1/unload_lora_adapter")


@pytest.fixture(scope="module")
def api(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BaseSchema]:
    # A short context bounds the work any generated request may ask for.
    engine = lora_engine(demo_model_dir, 32 << 20, max_model_len=64, max_waiting=512)
    app = build_test_app(
        engine,
        MODEL,
        tmp_path_factory.mktemp("tenancy"),
        demo_model_dir,
        settings={"max_adapter_bytes": 1 << 20},
        allow_runtime_lora_updating=True,
    )
    yield schemathesis.openapi.from_asgi("/openapi.json", app)
    asyncio.run(engine.shutdown(0))


def _headers(credentials: ServerTenancy, path: str) -> dict[str, str]:
    if path.startswith(ADMIN_PATHS):
        return {"Authorization": f"Bearer {credentials.admin_token}"}
    if path.startswith("/v1/"):
        return {"Authorization": f"Bearer {credentials.api_key}"}
    return {}


# Schemathesis's own pytest integration reads a pytest attribute that pytest 9 removed: the
# cases come from each operation's hypothesis strategy instead, valid and invalid ones.
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_every_answer_matches_the_schema(api: BaseSchema, mode: GenerationMode) -> None:
    credentials: ServerTenancy = api.app.state.server_tenancy  # type: ignore[union-attr]
    operations = [result.ok() for result in api.get_all_operations()]
    assert len(operations) >= 15
    for operation in operations:
        try:
            _check(operation, mode, _headers(credentials, operation.path))
        except Unsatisfiable:
            assert mode is GenerationMode.NEGATIVE  # nothing to get wrong (GET /health)
        except Exception as exc:
            raise AssertionError(f"{operation.label} ({mode.value}): {exc}") from exc


# 400s a schema cannot foresee (gateway.openai.serving, adapter validation, batch files' lines):
# the server's limits, the model's vocabulary and context, values that must agree, grammars,
# adapters and batch files that do not hold up. Any other 400 for schema-valid data means the
# schema promised too much.
SEMANTIC_CODES = {
    "above_server_limit",
    "invalid_token_id",
    "empty_prompt",
    "invalid_value",
    "invalid_grammar",
    "context_length_exceeded",
    "string_above_max_length",
    "invalid_adapter",
    "invalid_file",  # a batch file's lines, each checked as its route checks a request
    "empty_file",
}


@schemathesis.check
def accepts_schema_valid_data(ctx: CheckContext, response: Response, case: Case) -> bool | None:
    """Schemathesis's positive_data_acceptance, but for the 400s SEMANTIC_CODES name."""
    if (
        response.status_code == 400
        and case.meta is not None
        and case.meta.generation.mode.is_positive
    ) and response.json()["error"]["code"] in SEMANTIC_CODES:
        return None
    return positive_data_acceptance(ctx, response, case)


def _check(operation: APIOperation, mode: GenerationMode, headers: dict[str, str]) -> None:
    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
    def check(case: Case) -> None:
        case.call_and_validate(
            headers=headers,
            # Invalid cases: every check but "rejected", as unknown query parameters are
            # ignored by design (OpenAI's API ignores unknown fields) and this test adds the
            # credentials a case may have left out on purpose.
            excluded_checks=[positive_data_acceptance, negative_data_rejection],
            additional_checks=[accepts_schema_valid_data],
        )

    check()
