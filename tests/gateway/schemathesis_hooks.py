"""Hooks for the schemathesis CLI run (tests/gateway/test_schemathesis_cli.py): schema-valid
requests to the Responses API reach the model. A generated `model` names no model this server
serves, and a generated `previous_response_id` or `conversation` no id it handed out: each a
404 before anything runs. In a valid case they become the served model and nothing."""

from __future__ import annotations

import schemathesis
from schemathesis import Case
from schemathesis.hooks import HookContext

MODEL = "demo"  # the test server's
RUNS_THE_MODEL = ("/v1/responses", "/v1/responses/input_tokens", "/v1/responses/compact")
UNKNOWN_IDS = ("previous_response_id", "conversation")


@schemathesis.hook
def map_case(context: HookContext, case: Case) -> Case:
    positive = case.meta is not None and case.meta.generation.mode.is_positive
    if positive and case.operation.path in RUNS_THE_MODEL and isinstance(case.body, dict):
        body = {name: value for name, value in case.body.items() if name not in UNKNOWN_IDS}
        case.body = body | {"model": MODEL}
    return case
