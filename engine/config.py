"""EngineConfig: every engine knob, validated once at construction."""

from __future__ import annotations

from dataclasses import dataclass

from engine.spec_decode import SpeculativeConfig

GiB = 1 << 30
SCHEDULING_POLICIES = ("fair", "priority", "fcfs")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str
    tokenizer: str | None = None
    # auto: the checkpoint's dtype on CUDA (float32 ones in bfloat16); on the CPU bfloat16
    # where it has bf16 dot products (AVX-512 BF16, AMX), float32 elsewhere
    dtype: str = "auto"
    # "int8": int8 weights and activations for the decoder's projections (kernels/quant.py)
    quantization: str | None = None
    device: str = "auto"  # auto: cuda when available, else cpu
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes; CPU default 2 GiB
    memory_utilization: float = 0.9  # CUDA: fraction of device memory for weights + KV
    num_kv_blocks: int | None = None  # override the computed pool size (tests, benchmarks)
    max_num_seqs: int = 256
    # Tokens a step takes (the chunked-prefill budget). None: model_runner's
    # default_step_tokens, which is smaller on CPUs without AVX-512.
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    # Admission order of waiting requests: "fair": priority bands (lower first), each
    # fairness key's service weighed within a band (VTC, engine/fairness.py); "priority":
    # bands, arrival order within them (vLLM's); "fcfs": arrival order, priority and
    # fairness keys ignored (engine/priority.py).
    scheduling_policy: str = "fair"
    # Seconds a priority band with requests waiting may go without an admission while better
    # bands keep the engine busy; then its head is admitted next (bounded starvation).
    priority_max_wait: float = 30.0
    # A step holding a worse band's rows stops between layers for a better band's request
    # sent while it runs, and resumes there after that request's prompt step
    # (engine/give_way.py): the better band's first token no longer waits out the step.
    priority_step_yield: bool = True
    # Policy fair, while a key below its share of the service is present: the other keys'
    # prompt chunks are cut so that a step takes about this times that key's own first step
    # (its next request waits at most that long for the step under way; engine/scheduler.py).
    fair_delay_ratio: float = 0.5
    seed: int = 0
    # n-gram speculative decoding (engine/spec_decode.py); None: off.
    speculative_config: SpeculativeConfig | None = None
    enable_lora: bool = True
    max_loras: int = 4  # adapters resident at once (and so per step), at most
    max_lora_rank: int = 16
    max_cpu_loras: int = 16  # adapters kept in CPU memory (LRU) beyond the resident ones
    # Bytes of the pool resident adapters live in (engine/lora/pool.py), each at its own rank;
    # None: max_loras adapters of max_lora_rank.
    lora_memory: int | None = None
    num_threads: int | None = None  # torch intra-op threads; None: torch's default
    # Threads for steps whose linears are large (model_runner.LARGE_STEP_TOKEN_PARAMS: prompt
    # prefills, and decode steps of a real model) and for every step's vocabulary projection:
    # GEMMs large enough to pay for the cores the HTTP side keeps. None: num_threads.
    prefill_threads: int | None = None
    # Where the weights are kept as the engine runs them, converted and reordered, to be mapped
    # by the next load of the checkpoint (engine/checkpoints/weights_cache.py): auto
    # (~/.cache/loragate/weights), a directory, or none.
    weights_cache_dir: str = "auto"
    cpu_kernels: bool = True  # C++ decode attention, RMSNorm, LoRA on CPU (kernels.native)
    # Which kernels run (kernels/dispatch.py): auto (triton on CUDA; on the CPU native, or
    # torch without cpu_kernels), triton (on the CPU: under
    # triton's interpreter, for tests), native or torch.
    kernels: str = "auto"
    # Guided decoding (engine/guided/): limits on what a request may ask to compile.
    guided_compile_timeout: float = 10.0  # seconds a request waits for its grammar
    guided_cache_size: int = 256  # compiled grammars kept, least recently used dropped
    guided_max_schema_bytes: int = 64 << 10  # a schema (compact JSON), regex, grammar or choices
    guided_max_schema_depth: int = 32  # JSON nesting levels of a schema

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be positive")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
        if not 0.0 < self.memory_utilization <= 1.0:
            raise ValueError(f"memory_utilization must be in (0, 1], got {self.memory_utilization}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError("kv_cache_memory must be positive")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError("num_kv_blocks must be positive")
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be positive, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be positive, got {self.max_lora_rank}")
        if self.max_cpu_loras < 0:
            raise ValueError(f"max_cpu_loras must not be negative, got {self.max_cpu_loras}")
        if self.lora_memory is not None and self.lora_memory <= 0:
            raise ValueError("lora_memory must be positive")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(
                f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}"
            )
        if self.quantization not in (None, "int8"):
            raise ValueError(f"quantization must be int8 or unset, got {self.quantization!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if self.kernels not in ("auto", "triton", "native", "torch"):
            raise ValueError(f"kernels must be auto, triton, native or torch, got {self.kernels!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                f"got {self.scheduling_policy!r}"
            )
        if not 0.0 < self.priority_max_wait <= 86400.0:
            raise ValueError(
                f"priority_max_wait must be in (0, 86400] seconds, got {self.priority_max_wait}"
            )
        if not 0.0 < self.fair_delay_ratio <= 100.0:
            raise ValueError(f"fair_delay_ratio must be in (0, 100], got {self.fair_delay_ratio}")
        if self.guided_compile_timeout <= 0:
            raise ValueError("guided_compile_timeout must be positive")
        for name in ("guided_cache_size", "guided_max_schema_bytes", "guided_max_schema_depth"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive")
        if (
            not self.enable_chunked_prefill
            and self.max_model_len is not None
            and self.max_num_batched_tokens is not None
            and self.max_num_batched_tokens < self.max_model_len
        ):
            raise ValueError(
                "without chunked prefill max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) must be >= max_model_len ({self.max_model_len})"
            )
