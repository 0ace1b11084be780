"""xgrammar (after our normalizer) against llguidance (the raw schema), on the same schemas
and the same documents: which backend accepts a schema, how fast it compiles, and whether
its matcher accepts exactly the documents the `jsonschema` validator accepts.

    python -m bench.guided_backends --schemas DIR [--tokenizer models/smollm2] [--loose]
        [--max-docs N] [--json FILE]

A measurement for issue 15, not an integration: llguidance is a dev dependency only
(`llguidance==1.9.1` in pyproject.toml's dev extra; it pulls in nothing else), never the
engine's; without it the bench exits saying how to install it.

For every `*.json` schema in DIR, with one tokenizer (SmolLM2's by default):

1. Compile. xgrammar through the engine's own path: `GrammarCache` (check_schema, the
   normalizer, xgrammar's compile, the empty-grammar check), strict as `response_format`
   gives by default (`--loose`: strict off). llguidance on the raw schema,
   `grammar_from_json_schema` with compact separators and no free whitespace (what the
   engine's grammar allows), then `LLMatcher` and its first mask: llguidance builds its
   lexer lazily, so the first mask is part of the work xgrammar does ahead. A refusal is the
   backend's error (llguidance's is `LLMatcher.get_error()`); llguidance's grammar warnings
   are printed. Cold, one schema at a time; each backend's tokenizer set-up is not counted.
2. Documents. Candidates from the schema itself: its top-level `examples` and `default`,
   two documents built from it (a minimal one: required properties, defaults, first
   branches; a rich one: every property, last branches, one item per array, strings matching
   their pattern or format), then mutations of those two at every node (an extra property,
   a dropped property, a duplicated array item, an empty array, a string breaking a
   pattern/format/enum, an empty and a long string, numbers out of range, wrong types).
   Each is labelled by `jsonschema` (the schema's draft, its format checker); one the
   validator cannot resolve (an external $ref) is left out. Documents are compact JSON
   with keys in the schema's `properties` order, which both backends fix.
3. Exactness. Each document's tokens (the tokenizer's own encoding) are fed one by one to a
   fresh matcher of each backend, then a stop token: accepted means every token and the
   stop token were taken. Before each token the backend's mask is filled and timed, and
   checked to allow that token exactly when the matcher takes it. A backend that accepts a
   document the validator rejects is the dangerous disagreement; for xgrammar it is split
   into those covered by the normalizer's end checks (the gateway validates those at the
   end: oneOf that is not provably disjoint, uniqueItems) and silent ones.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.console import Console

from bench.guided_backends_compare import bench_schema
from bench.guided_backends_matchers import Llguidance, Xgrammar
from bench.guided_backends_report import print_report

DEFAULT_TOKENIZER = "models/smollm2"
INSTALL_HINT = (
    "llguidance is not installed; this bench measures it against xgrammar. Install it into "
    "the venv for the measurement only: .venv/bin/python -m pip install llguidance==1.9.1"
)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m bench.guided_backends", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--schemas", type=Path, required=True, metavar="DIR", help="*.json schemas")
    p.add_argument(
        "--tokenizer", default=DEFAULT_TOKENIZER, help="model directory (tokenizer, config)"
    )
    p.add_argument("--loose", action="store_true", help="xgrammar with strict mode off")
    p.add_argument("--max-docs", type=int, default=40, help="candidate documents per schema")
    p.add_argument("--json", type=Path, default=None, help="write the results to this file")
    args = p.parse_args(argv)
    try:
        import llguidance  # noqa: F401
    except ImportError:
        raise SystemExit(INSTALL_HINT) from None
    paths = sorted(args.schemas.glob("*.json"))
    if not paths:
        raise SystemExit(f"no *.json schemas in {args.schemas}")
    import transformers
    from transformers import AutoConfig, AutoTokenizer

    from engine.models.llama import eos_token_ids

    transformers.logging.set_verbosity_error()
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    hf_config = AutoConfig.from_pretrained(args.tokenizer)
    eos = sorted(eos_token_ids(hf_config, tokenizer, args.tokenizer))
    vocab_size = int(hf_config.vocab_size)
    backends: list[Any] = [
        Xgrammar(tokenizer, vocab_size, eos, args.tokenizer, strict=not args.loose),
        Llguidance(tokenizer, vocab_size, eos),
    ]
    names = [b.name for b in backends]
    console = Console() if Console().is_terminal else Console(width=160)
    rows = []
    for path in paths:
        schema = json.loads(path.read_text(encoding="utf-8"))
        t0 = time.perf_counter()
        rows.append(bench_schema(path.stem, schema, backends, tokenizer, args.max_docs))
        console.log(f"{path.stem}: {time.perf_counter() - t0:.1f} s")
    console.print(
        f"{len(paths)} schemas in {args.schemas}, tokenizer {args.tokenizer}, xgrammar "
        f"{'loose' if args.loose else 'strict'} after the normalizer, llguidance "
        f"{llguidance.__version__} on the raw schema"
    )
    total = print_report(rows, names, console)
    if args.json is not None:
        out: dict[str, Any] = {"summary": total, "rows": [asdict(r) for r in rows]}
        for r in out["rows"]:
            for b in r["backends"].values():
                b["mask_us"] = len(b["mask_us"])  # the count; the percentiles are in the summary
        args.json.write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
        console.print(f"results written to {args.json}")


if __name__ == "__main__":
    main()
