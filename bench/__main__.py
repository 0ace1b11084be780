"""`loragate-bench NAME [options]` (or `python -m bench NAME`): the benchmarks, each a module of
this package with its own `main(argv)` and argparse options (`NAME --help`). The product's
`loragate` command never imports them: the arrows run from bench to the engine and gateway,
not back."""

from __future__ import annotations

import importlib
import sys

from kernels import cpu_features

# name: (module, what it measures)
BENCHMARKS: dict[str, tuple[str, str]] = {
    "offline": ("bench.offline", "our engine vs Hugging Face generate on W1/W2/Wv, or W3"),
    "lora": ("bench.lora", "multi-LoRA W3 vs base-only W1 and vs peft"),
    "lora-scale": (
        "bench.lora_scale",
        "S-LoRA's trace: 1000 adapters, power-law picks, vs one adapter; TTFT by residency",
    ),
    "lora-scale-vs-vllm": (
        "bench.lora_scale_vs_vllm",
        "lora-scale's trace over HTTP: loragate serve and vLLM-CPU with --enable-lora",
    ),
    "lora-kernel": ("bench.lora_kernel", "the multi-LoRA op against the linears it rides on"),
    "serve": ("bench.serve", "load-test any OpenAI-compatible server"),
    "containment": ("bench.containment", "W1 clean and with one request failing its steps"),
    "upload": ("bench.upload", "time to register an adapter through the admin REST"),
    "guided": ("bench.guided", "guided vs unguided decode on W1, grammar compile times"),
    "tools": ("bench.tool_calls", "forced tool calls against any server: validity, cost"),
    "vs-vllm": ("bench.vs_vllm", "loragate and vLLM-CPU taking turns on W1/W2, ratios"),
    "spec-decode": ("bench.spec_decode", "n-gram speculative decoding vs none"),
    "quantization": ("bench.quantization", "int8 vs float32 and the compute dtype: quality, W1"),
    "agreement": ("bench.agreement", "greedy agreement with transformers in bfloat16"),
    "kernels": ("bench.kernels", "the triton kernels on a GPU (--toy: the CPU interpreter)"),
    "linears": ("bench.linears", "float32 GEMMs per shape: our panels, oneDNN and F.linear"),
    "fairness": ("bench.fairness", "a tenant flooding at 10x another's rate; weighted shares"),
    "coldstart": ("bench.coldstart", "a model's engine from nothing to its first token, by phase"),
    "routing": ("bench.routing", "affinity routing against round-robin over two engines"),
    "remote-hop": ("bench.remote_hop", "W1 through `loragate engine` against the engine beside it"),
    "update-bytes": (
        "bench.update_bytes",
        "a stream's updates over the engine pipe: text deltas vs the whole text each step",
    ),
    "responses": ("bench.responses", "a conversation through /v1/responses: TTFT per turn, bytes"),
    "open-responses": (
        "bench.open_responses",
        "the Open Responses compliance templates against any server, checked against the spec",
    ),
    "batch": (
        "bench.batch",
        "interactive TTFT alone and beside a batch; the batch's tok/s alone and beside traffic",
    ),
    "console-usage": (
        "bench.console_usage",
        "the admin console's usage queries on 1M PostgreSQL rows, without and with 0005",
    ),
}


def usage() -> str:
    width = max(map(len, BENCHMARKS))
    rows = "\n".join(f"  {name:<{width}}  {help}" for name, (_, help) in BENCHMARKS.items())
    return f"usage: loragate-bench NAME [options]   (NAME --help lists its options)\n\n{rows}\n"


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args[0] in ("-h", "--help"):
        print(usage(), end="")
        return
    name, rest = args[0], args[1:]
    if name not in BENCHMARKS:
        sys.exit(f"loragate-bench: no benchmark {name!r}\n\n{usage()}")
    if not {"-h", "--help"} & set(rest):
        # Every figure is this processor's: its model and flags head every run (on stderr, out
        # of the way of a benchmark that prints JSON).
        print(f"loragate-bench {name} on {cpu_features.describe()}", file=sys.stderr)
    if name == "offline" and _option_value(rest, "--workload") == "w3":
        name, rest = "lora", _without_option(rest, "--workload")  # W3 needs adapters
    importlib.import_module(BENCHMARKS[name][0]).main(rest)


def _without_option(args: list[str], name: str) -> list[str]:
    out, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg == name:
            skip = True
        elif not arg.startswith(name + "="):
            out.append(arg)
    return out


def _option_value(args: list[str], name: str) -> str | None:
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


if __name__ == "__main__":
    main()
