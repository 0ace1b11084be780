"""The product's signatures stay small (issue 42): no function takes more than six parameters,
and no parameter is a bool that picks between two behaviours; several values that travel
together are one frozen dataclass, two behaviours are two functions.

Exempt, because their parameters are an interface fixed elsewhere: triton kernels (one
parameter per pointer, stride and constexpr the launch passes), FastAPI routes (each parameter
is a query field of the HTTP API) and typer commands (each is a CLI flag)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("engine", "kernels", "adapters", "tenants", "gateway")
MOST_PARAMETERS = 6
# Decorators whose function's parameters are an interface fixed outside the function.
INTERFACE_DECORATORS = (
    "triton.jit",
    ".command(",
    ".get(",
    ".post(",
    ".put(",
    ".delete(",
    ".patch(",
)
# Bool parameters that carry a value of the data (a checkpoint's bias, an adapter's rslora,
# a pool's caching setting), not a choice between two code paths inside the function.
DATA_BOOLS = {
    "skip_special_tokens",
    "enable_caching",
    "enable_chunked_prefill",
    "bias",
    "qkv_bias",
    "rslora",
    "reordered",
    "scaling",
    "finished",
    "condition",
    "has_more",
    "enabled",
    "gated",
    "use_keys",
    "cpu_kernels",
}


def _functions() -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            where = path.relative_to(ROOT).as_posix()
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    decorators = " ".join(ast.unparse(d) for d in node.decorator_list)
                    if not any(mark in decorators for mark in INTERFACE_DECORATORS):
                        yield f"{where}:{node.lineno} {node.name}", node


def _parameters(node: ast.FunctionDef | ast.AsyncFunctionDef) -> list[ast.arg]:
    args = node.args
    every = args.posonlyargs + args.args + args.kwonlyargs
    return [a for a in every if a.arg not in ("self", "cls")]


def test_no_function_takes_more_than_six_parameters() -> None:
    long = [
        f"{where} ({len(_parameters(node))})"
        for where, node in _functions()
        if len(_parameters(node)) > MOST_PARAMETERS
    ]
    assert not long, "more than six parameters:\n" + "\n".join(long)


def test_no_bool_parameter_picks_a_behaviour() -> None:
    flags = [
        f"{where} {arg.arg}"
        for where, node in _functions()
        for arg in _parameters(node)
        if arg.annotation is not None
        and ast.unparse(arg.annotation) == "bool"
        and arg.arg not in DATA_BOOLS
    ]
    assert not flags, "bool parameters that pick a behaviour:\n" + "\n".join(flags)
