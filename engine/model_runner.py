"""Turn a SchedulerOutput into one forward pass and sampled tokens.

Every scheduled token of every request is flattened into one "super
sequence": input_ids, positions and KV slots, decode rows first, then prefill
rows. Only rows that have caught up with all their known tokens are sampled;
a partial prompt chunk only writes its KV.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from transformers import PretrainedConfig

from engine import heap
from engine.checkpoints import checkpoint_map
from engine.checkpoints.weights_cache import WeightsCache, cache_for
from engine.config import EngineConfig
from engine.give_way import StepYielded
from engine.kv_cache.manager import KVCacheManager
from engine.load_timings import LoadTimings
from engine.lora.manager import LoRAManager
from engine.models.llama import (
    SUPPORTED_ARCHITECTURES,
    LlamaForCausalLM,
    RotaryEmbedding,
    iter_safetensors,
    weight_names,
    weights_from_checkpoint,
)
from engine.request import Request
from engine.sampler import Sampler, SamplerOutput
from engine.scheduler import SchedulerOutput
from engine.spec_decode import verify
from kernels import cpu_features, dispatch, linear, native, quant
from kernels.attention import AttentionPlan, StepMetadata

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU_DEFAULT_KV_CACHE_MEMORY = 2 << 30
# Steps whose linears multiply at least this many token-parameters run on
# config.prefill_threads: about 256 tokens of the 6.5M-parameter demo model, where a decode
# step is Python and waking a second core costs more than it gives, and 13 tokens of
# SmolLM2-135M, whose decode steps of 16 sequences are GEMMs 1.45x faster on two cores (27.2
# vs 18.9 ms). Smaller steps run on config.num_threads, but for the logits.
LARGE_STEP_TOKEN_PARAMS = 1_700_000_000

ProgressFn = Callable[[int, int], None]


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, hf_config: PretrainedConfig, device: torch.device) -> torch.dtype:
    if name != "auto":
        return DTYPES[name]
    if device.type == "cpu":
        # As vLLM does: bfloat16 where the CPU has bf16 dot products, whatever the
        # checkpoint holds; float32 elsewhere, where bf16 is emulated and slower.
        return torch.bfloat16 if linear.native_bf16() else torch.float32
    checkpoint = getattr(hf_config, "torch_dtype", None) or getattr(hf_config, "dtype", None)
    if isinstance(checkpoint, str):
        checkpoint = DTYPES.get(checkpoint)
    return checkpoint if checkpoint in (torch.bfloat16, torch.float16) else torch.bfloat16


# Tokens a step takes unless max_num_batched_tokens says. On a processor without AVX-512 a
# step's linears run in float32 on 256-bit vectors, and a step of 2,048 prompt tokens held
# every stream's next token for its whole length: 512 halved the time to first token there
# (demo model and SmolLM2, 16 concurrent streams), at the same throughput (issue 43). With
# AVX-512 the larger step kept 2-7 % more throughput for a smaller gain in TTFT.
DEFAULT_STEP_TOKENS = 2048
AVX2_STEP_TOKENS = 512


def default_step_tokens(device: torch.device, must_fit: int = 0) -> int:
    """The step token budget for this device, never below `must_fit` (without chunked
    prefill a whole prompt of max_model_len tokens must fit one step)."""
    wide_vectors = device.type != "cpu" or "avx512f" in cpu_features.flags()
    return max(DEFAULT_STEP_TOKENS if wide_vectors else AVX2_STEP_TOKENS, must_fit)


@dataclass(slots=True)
class _StepBatch:
    """One step flattened: per token (ids, positions, KV slots, adapter slots), per attention
    row (query and sequence lengths, block tables), and the rows that sample."""

    input_ids: np.ndarray
    positions: np.ndarray
    slots: np.ndarray
    token_lora_slots: np.ndarray
    query_lens: np.ndarray
    seq_lens: np.ndarray
    num_decode: int  # decode tokens, first in the batch
    block_tables: list[list[int]] = field(default_factory=list)
    sample_rows: list[Request] = field(default_factory=list)
    sample_index: list[int] = field(default_factory=list)  # their tokens' places
    spec_rows: list[tuple[Request, list[int]]] = field(default_factory=list)  # and drafts
    spec_index: list[int] = field(default_factory=list)


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        hf_config: PretrainedConfig,
        max_model_len: int,
        progress: ProgressFn | None = None,
        calibration: list[list[int]] | None = None,
        timings: LoadTimings | None = None,
    ) -> None:
        """`calibration`: token ids to smooth int8 activations on (config.quantization);
        `timings`: where the phases of the load are marked."""
        timings = timings or LoadTimings()
        self.config = config
        self.block_size = config.block_size
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, hf_config, self.device)
        self.max_num_batched_tokens = config.max_num_batched_tokens or default_step_tokens(
            self.device, 0 if config.enable_chunked_prefill else max_model_len
        )
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.decode_threads = torch.get_num_threads()
        self.prefill_threads = config.prefill_threads or self.decode_threads
        architectures = set(getattr(hf_config, "architectures", None) or ["LlamaForCausalLM"])
        if not architectures & SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {sorted(architectures)}; "
                f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        model_dir = Path(config.model)
        names = weight_names(model_dir)
        qkv_bias = any(n.endswith("q_proj.bias") for n in names)
        head_dim = (
            getattr(hf_config, "head_dim", None)
            or hf_config.hidden_size // hf_config.num_attention_heads
        )
        timings.mark("setup")
        # The engine's one kernel choice, handed to every module that runs a kernel.
        self.kernels = dispatch.choose(
            config.kernels, self.device, self.dtype, config.cpu_kernels, head_dim, self.block_size
        )
        timings.mark("kernels")
        torch.manual_seed(config.seed)
        self.model = self._build_model(hf_config, max_model_len, qkv_bias, head_dim)
        # Counted before the linears are reordered, which leaves them no parameters.
        num_params = sum(p.numel() for p in self.model.parameters())
        attn = self.model.first_attention
        self.num_layers = len(self.model.layers)
        # A step of more tokens than this runs on prefill_threads (LARGE_STEP_TOKEN_PARAMS).
        self.large_step_tokens = max(1, -(-LARGE_STEP_TOKEN_PARAMS // max(1, num_params)))
        self.num_kv_heads = attn.num_kv_heads
        self.head_dim = attn.head_dim
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.lora: LoRAManager | None = None  # set by the engine when LoRA is enabled
        self.sampler = Sampler(self.device, config.seed)
        self.vocab_size = int(hf_config.vocab_size)
        timings.mark("model")
        reordered = config.cpu_kernels and self.device.type == "cpu" and linear.available()
        cache = self._weights_cache(config, reordered)
        if cache is not None and cache.load(self.model, model_dir, self.dtype, reordered):
            checkpoint_map.take(model_dir)  # mapped ahead by a spare or the zygote: not needed
            if progress is not None:
                progress(len(names), len(names))
            timings.mark("weights")
        else:
            self._load_checkpoint(model_dir, names, progress, config, calibration, timings)
            if reordered:
                linear.prepack(self.model)
            timings.mark("prepack")
            # Written once, then mapped like any later load's: this engine's weights become the
            # page cache's, which the next engine of this checkpoint shares.
            if cache is not None and cache.save(self.model, model_dir, self.dtype, reordered):
                cache.load(self.model, model_dir, self.dtype, reordered)
                timings.mark("cache")

    def _weights_cache(self, config: EngineConfig, reordered: bool) -> WeightsCache | None:
        """The weights cache, where it applies (engine.checkpoints.weights_cache.cache_for) and, for
        reordered weights, where the kernel that maps them back is built."""
        if reordered and not native.load():
            return None
        return cache_for(config, self.device)

    def _load_checkpoint(
        self,
        model_dir: Path,
        names: list[str],
        progress: ProgressFn | None,
        config: EngineConfig,
        calibration: list[list[int]] | None,
        timings: LoadTimings,
    ) -> None:
        total = len(names)
        done = 0

        def on_tensor(_: str) -> None:
            nonlocal done
            done += 1
            if progress is not None:
                progress(done, total)

        with torch.no_grad():
            self.model.load_weights(iter_safetensors(model_dir), on_tensor)
        timings.mark("weights")
        if config.quantization is not None:
            self._quantize(calibration or [])
            timings.mark("quantize")

    def _build_model(
        self, hf_config: PretrainedConfig, max_model_len: int, qkv_bias: bool, head_dim: int
    ) -> LlamaForCausalLM:
        """The module tree in the compute dtype, its parameters allocated and not initialized:
        every one is filled from the checkpoint next (load_weights checks). Built on the meta
        device, where nothing is computed, then given storage. The rotary tables are computed
        for real, in float32 rounded through the compute dtype, as they always were."""

        def rotary() -> RotaryEmbedding:
            with torch.device(self.device):
                return RotaryEmbedding(hf_config, head_dim, max_model_len)

        with torch.device("meta"), weights_from_checkpoint():
            model = LlamaForCausalLM(
                hf_config, max_model_len, self.kernels, qkv_bias, rotary=rotary()
            )
        model = model.to(self.dtype).to_empty(device=self.device)
        model.tie_weights()  # to_empty gave the tied weights storage of their own
        model.rotary = rotary().to(self.dtype).to(torch.float32)
        return model.eval()

    def _quantize(self, calibration: list[list[int]]) -> None:
        """SmoothQuant on the calibration text, then int8 projections (kernels/quant.py)."""
        if not calibration:
            raise ValueError("int8 quantization needs calibration text")
        ranges = quant.activation_ranges(self.model, self.forward_prompt, calibration)
        quant.smooth(self.model, ranges, quant.SMOOTHING_ALPHA)
        count = self.kernels.quantize(self.model)
        logger.info("int8: %d projections smoothed and quantized", count)

    @torch.inference_mode()
    def forward_prompt(self, token_ids: list[int]) -> torch.Tensor:
        """Hidden states of one prompt from scratch, outside the KV pool (a scratch cache of
        one block of its length per layer): calibration and perplexity."""
        n = len(token_ids)
        scratch = [
            tuple(
                torch.zeros(
                    self.num_kv_heads, 1, n, self.head_dim, dtype=self.dtype, device=self.device
                )
                for _ in range(2)
            )
            for _ in range(self.num_layers)
        ]
        plan = self._one_prompt_plan(n)
        ids = torch.tensor(token_ids, device=self.device)
        hidden: torch.Tensor = self.model(ids, torch.arange(n, device=self.device), plan, scratch)
        return hidden

    def _one_prompt_plan(self, n: int) -> AttentionPlan:
        """One prompt of `n` tokens from scratch over a scratch cache of one block of `n`."""
        return self.kernels.plan(
            StepMetadata(np.array([n]), np.array([n]), [[0]], np.arange(n), 0, n)
        )

    @property
    def bytes_per_block(self) -> int:
        elem = torch.finfo(self.dtype).bits // 8
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem

    def num_blocks_for_memory(self) -> int:
        """The KV pool size: an explicit override, kv_cache_memory, or free CUDA memory."""
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        if self.device.type == "cuda" and self.config.kv_cache_memory is None:
            budget = self._profile_cuda_kv_budget()
        else:
            budget = self.config.kv_cache_memory or CPU_DEFAULT_KV_CACHE_MEMORY
        return max(0, budget // self.bytes_per_block)

    def _profile_cuda_kv_budget(self) -> int:
        """Run a forward of max_num_batched_tokens to find peak activation memory,
        then give the KV cache what remains of memory_utilization."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        n = self.max_num_batched_tokens
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        pos = torch.arange(n, device=self.device) % self.model.rotary.cos.shape[0]
        scratch = [
            (
                torch.zeros(
                    self.num_kv_heads, 1, n, self.head_dim, dtype=self.dtype, device=self.device
                ),
            )
            * 2
            for _ in range(self.num_layers)
        ]
        plan = self._one_prompt_plan(n)
        with torch.no_grad():
            self.model.compute_logits(self.model(ids, pos, plan, scratch)[-1:])
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated(self.device)
        del scratch
        torch.cuda.empty_cache()
        _, total = torch.cuda.mem_get_info(self.device)
        return max(0, int(total * self.config.memory_utilization) - peak)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        shape = (self.num_kv_heads, num_blocks, self.block_size, self.head_dim)
        # Zeroed, not empty: padded attention reads stale slots with weight 0,
        # and 0 * NaN garbage would still be NaN. On the CPU, zeroed by the kernel as each
        # page is first written (engine.heap): a start writes none of the pool.
        if self.device.type == "cpu":
            flat = heap.lazily_zeroed([shape] * (2 * self.num_layers), self.dtype)
            self.kv_caches = list(zip(flat[0::2], flat[1::2], strict=True))
            return
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device),
            )
            for _ in range(self.num_layers)
        ]

    @staticmethod
    def _set_threads(threads: int) -> None:
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)

    @torch.inference_mode()
    def execute(
        self,
        sched: SchedulerOutput,
        kv: KVCacheManager,
        give_way: Callable[[], bool] | None = None,
    ) -> tuple[list[Request], SamplerOutput | None]:
        """One step: its rows flattened into one batch, one forward pass, then the sampled
        rows (and the speculating rows' verified drafts). `give_way`, asked between layers:
        stop the step (StepYielded, whose `resume` runs the rest of it and returns what this
        would have) for a better band's request (engine/give_way.py)."""
        batch = self._flatten(self._order_rows(sched), sched.num_batched_tokens, kv)
        large = sched.num_batched_tokens >= self.large_step_tokens
        self._set_threads(self.prefill_threads if large else self.decode_threads)
        plan = self.kernels.plan(
            StepMetadata(
                batch.query_lens,
                batch.seq_lens,
                batch.block_tables,
                batch.slots,
                batch.num_decode,
                self.block_size,
            )
        )
        ids_t = torch.from_numpy(batch.input_ids).to(self.device)
        pos_t = torch.from_numpy(batch.positions).to(self.device)
        lora = None if self.lora is None else self.lora.step_context(batch.token_lora_slots)
        if batch.sample_rows:  # guided rows' masks fill on a helper thread beside the forward
            self.sampler.grammar_bitmask.prefetch(batch.sample_rows, self.vocab_size, self.device)
        try:
            hidden = self.model(ids_t, pos_t, plan, self.kv_caches, lora, give_way)
        except StepYielded as yielded:
            raise self._suspend(yielded, batch) from None
        return self._finish(batch, hidden)

    def _suspend(self, yielded: StepYielded, batch: _StepBatch) -> StepYielded:
        """The model's yield, resumed into the rest of this step: its threads set again (the
        interim steps set their own), then its sampling."""
        threads = torch.get_num_threads()

        @torch.inference_mode()
        def resume() -> tuple[list[Request], SamplerOutput | None]:
            self._set_threads(threads)
            try:
                hidden = yielded.resume()
            except StepYielded as again:
                raise self._suspend(again, batch) from None
            return self._finish(batch, hidden)

        return StepYielded(resume)

    def _finish(
        self, batch: _StepBatch, hidden: torch.Tensor
    ) -> tuple[list[Request], SamplerOutput | None]:
        if not batch.sample_rows and not batch.spec_rows:
            return [], None
        return self._sample(batch, hidden)

    def _order_rows(self, sched: SchedulerOutput) -> list[tuple[Request, int]]:
        """Decode rows first: a caught-up request's last token, and its drafts if it
        speculates (engine/spec_decode.py), each token an attention row of its own over the
        request's blocks. Within decode rows and within prefill rows, as the kernels rank
        them (`Kernels.row_rank`): the torch attention groups decode rows of similar length,
        so they go shortest first; the C++ and triton kernels pad nothing, so there rows go
        by LoRA slot: each adapter's tokens are then one run of rows (two with prefills)."""
        rank = self.kernels.row_rank

        def key(item: tuple[Request, int]) -> tuple[bool, int]:
            request = item[0]
            is_decode = request.num_computed_tokens + 1 == request.num_tokens
            return not is_decode, rank(request.num_computed_tokens, request.lora_slot)

        return sorted(sched.scheduled, key=key)

    def _flatten(
        self, rows: list[tuple[Request, int]], num_tokens: int, kv: KVCacheManager
    ) -> _StepBatch:
        """Every scheduled token of every row in one super sequence (ids, positions, KV slots,
        adapter slots), an attention row per prefill chunk and per decode token, and which
        tokens are sampled."""
        bs = self.block_size
        decode = [r.num_computed_tokens + 1 == r.num_tokens for r, _ in rows]
        num_decode = sum(n for (_, n), d in zip(rows, decode, strict=True) if d)
        num_attention_rows = num_decode + decode.count(False)
        batch = _StepBatch(
            input_ids=np.empty(num_tokens, dtype=np.int64),
            positions=np.empty(num_tokens, dtype=np.int64),
            slots=np.empty(num_tokens, dtype=np.int64),
            token_lora_slots=np.empty(num_tokens, dtype=np.int64),
            query_lens=np.ones(num_attention_rows, dtype=np.int64),
            seq_lens=np.empty(num_attention_rows, dtype=np.int64),
            num_decode=num_decode,
        )
        input_ids, positions, slots = batch.input_ids, batch.positions, batch.slots
        seq_lens, block_tables = batch.seq_lens, batch.block_tables
        t = a = 0  # the next token, the next attention row
        for (request, n), is_decode_row in zip(rows, decode, strict=True):
            start = request.num_computed_tokens
            table = kv.block_ids(request.request_id)
            if n == 1:  # decode: plain ints beat numpy's per-call overhead
                positions[t] = start
                input_ids[t] = request.all_token_ids[start]
                slots[t] = table[start // bs] * bs + start % bs
            else:
                pos = np.arange(start, start + n)
                positions[t : t + n] = pos
                known = request.all_token_ids[start : start + n]
                input_ids[t : t + len(known)] = known
                input_ids[t + len(known) : t + n] = request.spec_token_ids[: n - len(known)]
                slots[t : t + n] = np.asarray(table)[pos // bs] * bs + pos % bs
            batch.token_lora_slots[t : t + n] = request.lora_slot
            if is_decode_row and n == 1:
                seq_lens[a] = start + 1
                block_tables.append(table)
                a += 1
                batch.sample_rows.append(request)
                batch.sample_index.append(t)
            elif is_decode_row:  # the last token and its drafts: one query token each
                seq_lens[a : a + n] = np.arange(start + 1, start + n + 1)
                block_tables.extend([table] * n)
                a += n
                batch.spec_rows.append((request, request.spec_token_ids[: n - 1]))
                batch.spec_index.extend(range(t, t + n))
            else:
                batch.query_lens[a] = n
                seq_lens[a] = start + n
                block_tables.append(table)
                a += 1
                if start + n == request.num_tokens:
                    batch.sample_rows.append(request)
                    batch.sample_index.append(t + n - 1)
            t += n
        return batch

    def _sample(
        self, batch: _StepBatch, hidden: torch.Tensor
    ) -> tuple[list[Request], SamplerOutput]:
        sample_rows, sample_index, spec_rows = (
            batch.sample_rows,
            batch.sample_index,
            batch.spec_rows,
        )
        index = torch.tensor(sample_index + batch.spec_index, device=self.device)
        # The vocabulary projection is the step's one large GEMM: it runs on prefill_threads.
        self._set_threads(self.prefill_threads)
        logits = self.model.compute_logits(hidden[index])
        self._set_threads(self.decode_threads)
        out = (
            self.sampler(logits[: len(sample_index)], sample_rows)
            if sample_rows
            else SamplerOutput([], [])
        )
        if not spec_rows:
            return sample_rows, out
        out.accepted_drafts = [[] for _ in sample_rows]
        offset = len(sample_index)
        for request, drafts in spec_rows:
            end = offset + len(drafts) + 1
            tokens = verify(logits[offset:end], request, drafts, self.sampler)
            offset = end
            out.token_ids.append(tokens[-1])
            out.logprobs.append(None)
            out.accepted_drafts.append(tokens[:-1])
        return sample_rows + [request for request, _ in spec_rows], out
