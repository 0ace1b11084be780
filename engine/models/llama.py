"""Llama-family decoder (Llama, Mistral, Qwen2) over a paged KV cache, loading HF weights.

The forward pass takes the step's flattened tokens ([num_tokens]) with their
positions and one AttentionPlan; there is no batch dimension and no padding
outside attention. q/k/v and gate/up are fused into one matmul each at load.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn
from transformers import PretrainedConfig
from transformers.activations import ACT2FN
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from engine.checkpoints import checkpoint_map
from engine.checkpoints.checkpoint_map import safetensors_files
from engine.give_way import StepYielded
from engine.lora.types import DOWN, GATE_UP, O_PROJ, QKV
from kernels.attention import AttentionPlan
from kernels.backend import Kernels, LoRAStep, Rope
from kernels.linear import GateUpPanelLinear
from kernels.quant import Int8Linear

SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"}
# Rope types whose frequencies do not depend on the running sequence length.
STATIC_ROPE_TYPES = {"default", "linear", "llama3", "yarn"}


# Parameters an engine fills from its checkpoint need no random initialization, which was
# most of a cold start's model phase: constructors read this, in this thread (or task) only.
_SKIP_INIT: ContextVar[bool] = ContextVar("skip_init", default=False)


@contextlib.contextmanager
def weights_from_checkpoint() -> Iterator[None]:
    """Modules built here leave their parameters uninitialized: every one must then be
    loaded (`LlamaForCausalLM.load_weights` checks that each is)."""
    token = _SKIP_INIT.set(True)
    try:
        yield
    finally:
        _SKIP_INIT.reset(token)


class Linear(nn.Linear):
    def reset_parameters(self) -> None:
        if not _SKIP_INIT.get():
            super().reset_parameters()


class Embedding(nn.Embedding):
    def reset_parameters(self) -> None:
        if not _SKIP_INIT.get():
            super().reset_parameters()


class RMSNorm(nn.Module):
    """RMSNorm on the engine's kernels, rounded as HF rounds it (kernels.backend.Kernels)."""

    def __init__(self, hidden_size: int, eps: float, kernels: Kernels) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.rms_norm(x, self.weight, self.eps)

    def add_forward(self, residual: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """residual += delta (in place), then the norm of the sum."""
        return self.kernels.add_rms_norm(residual, delta, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """float32 cos/sin tables for every position up to max_model_len, which each step's
    rope reads (`Kernels.rope`)."""

    cos: torch.Tensor
    signed_sin: torch.Tensor

    def __init__(self, config: PretrainedConfig, head_dim: int, max_len: int) -> None:
        super().__init__()
        rope = getattr(config, "rope_parameters", None) or {"rope_type": "default"}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in STATIC_ROPE_TYPES:
            raise ValueError(
                f"rope type {rope_type!r} is not supported (supported: {sorted(STATIC_ROPE_TYPES)})"
            )
        if rope_type == "default":
            base = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
            inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
            scaling = 1.0
        else:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, None)
        freqs = torch.arange(max_len, dtype=torch.float)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        sin = emb.sin() * scaling
        half = head_dim // 2
        # rotate_half(x) * sin == roll(x, half) * signed_sin: the sign flip is exact.
        signed_sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("signed_sin", signed_sin, persistent=False)


class Attention(nn.Module):
    def __init__(self, config: PretrainedConfig, bias: bool, layer: int, kernels: Kernels) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads: int = config.num_attention_heads
        self.num_kv_heads: int = config.num_key_value_heads
        self.head_dim: int = (
            getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        )
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=False)
        self.kernels = kernels

    def forward(
        self,
        rope: Rope,
        x: torch.Tensor,
        plan: AttentionPlan,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        lora: LoRAStep | None,
    ) -> torch.Tensor:
        n = x.shape[0]
        qkv = self.qkv_proj(x)
        if lora is not None:
            lora.apply(self.layer, QKV, x, qkv)
        # q and k heads side by side: one rotary pass for both.
        qk = qkv[:, : self.q_size + self.kv_size].view(n, -1, self.head_dim)
        qk = self.kernels.rotate(qk, rope)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, self.q_size + self.kv_size :].view(n, self.num_kv_heads, self.head_dim)
        out = self.kernels.attend(q, k, v, kv_cache, plan, self.scale).view(n, self.q_size)
        y: torch.Tensor = self.o_proj(out)
        if lora is not None:
            lora.apply(self.layer, O_PROJ, out, y)
        return y


class MLP(nn.Module):
    def __init__(self, config: PretrainedConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)
        act = config.hidden_act
        self.act: Callable[[torch.Tensor], torch.Tensor] = F.silu if act == "silu" else ACT2FN[act]

    def forward(self, x: torch.Tensor, lora: LoRAStep | None) -> torch.Tensor:
        if lora is None and self.act is F.silu and isinstance(self.gate_up_proj, GateUpPanelLinear):
            # silu(gate) * up as the gate/up panels are multiplied (kernels/linear.py); a LoRA
            # adds to gate and up before the activation, so LoRA steps take the path below.
            fused: torch.Tensor = self.down_proj(self.gate_up_proj.silu_mul(x))
            return fused
        gate_up = self.gate_up_proj(x)
        if lora is not None:
            lora.apply(self.layer, GATE_UP, x, gate_up)
        elif self.act is F.silu and isinstance(self.down_proj, Int8Linear):
            # silu(gate) * up inside the int8 linear's quantization; a LoRA on down_proj
            # needs its input as a tensor of its own, so LoRA steps take the path below.
            return self.down_proj.forward_gated(gate_up)
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        h = self.act(gate) * up
        y: torch.Tensor = self.down_proj(h)
        if lora is not None:
            lora.apply(self.layer, DOWN, h, y)
        return y


class DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, bias: bool, layer: int, kernels: Kernels) -> None:
        super().__init__()
        self.self_attn = Attention(config, bias, layer, kernels)
        self.mlp = MLP(config, layer)
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, kernels)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, kernels)

    def forward(
        self,
        rope: Rope,
        residual: torch.Tensor,
        delta: torch.Tensor | None,
        plan: AttentionPlan,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        lora: LoRAStep | None,
    ) -> torch.Tensor:
        """The residual stream is `residual + delta` (delta: the previous layer's MLP output,
        None before the first layer) and is updated in place: each residual add happens in
        the norm after it. Returns this layer's MLP output, the next delta."""
        if delta is None:
            h = self.input_layernorm(residual)
        else:
            h = self.input_layernorm.add_forward(residual, delta)
        attn = self.self_attn(rope, h, plan, kv_cache, lora)
        h = self.post_attention_layernorm.add_forward(residual, attn)
        mlp_out: torch.Tensor = self.mlp(h, lora)
        return mlp_out


class LlamaForCausalLM(nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        max_model_len: int,
        kernels: Kernels,
        qkv_bias: bool = False,
        rotary: RotaryEmbedding | None = None,
    ) -> None:
        """`kernels`: the engine's kernels (kernels.dispatch.choose), which the norms,
        rotary, KV writes and attention run on. `rotary`: tables computed already (a model
        built on the meta device cannot compute its own)."""
        super().__init__()
        self.config = config
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        head_dim = (
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        self.rotary = rotary or RotaryEmbedding(config, head_dim, max_model_len)
        self.layers = nn.ModuleList(
            DecoderLayer(config, qkv_bias, i, kernels) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()
        self.kernels = kernels

    def tie_weights(self) -> None:
        """The output projection is the embedding, where the config ties them (again after
        a move that gave each its own storage, as `to_empty` does)."""
        if self.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        plan: AttentionPlan,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        lora: LoRAStep | None = None,
        give_way: Callable[[], bool] | None = None,
    ) -> torch.Tensor:
        """The last layer's normed hidden states. `give_way`, asked before every layer but
        the first one a call runs: True stops the pass (StepYielded, whose `resume` runs the
        rest of it; engine/give_way.py)."""
        residual = self.embed_tokens(input_ids)
        rotary = self.rotary
        rope = self.kernels.rope(positions, rotary.cos, rotary.signed_sin, residual.dtype)
        layers = list(zip(self.layers, kv_caches, strict=True))

        def run(start: int, delta: torch.Tensor | None) -> torch.Tensor:
            # The layers add into `residual` in place: a suspended pass is this closure.
            for i in range(start, len(layers)):
                if i > start and give_way is not None and give_way():
                    raise StepYielded(functools.partial(run, i, delta))
                layer, kv_cache = layers[i]
                delta = layer(rope, residual, delta, plan, kv_cache, lora)
            return self.norm(residual) if delta is None else self.norm.add_forward(residual, delta)

        return run(0, None)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.lm_head(hidden)
        return logits.float()

    def load_weights(
        self,
        weights: Iterator[tuple[str, torch.Tensor]],
        progress: Callable[[str], None] | None = None,
    ) -> None:
        """Copy HF-named tensors in, fusing q/k/v and gate/up. Every parameter must be filled."""
        params = dict(self.named_parameters())
        filled: set[str] = set()
        fused = {
            "q_proj": ("self_attn.qkv_proj", 0),
            "k_proj": ("self_attn.qkv_proj", 1),
            "v_proj": ("self_attn.qkv_proj", 2),
            "gate_proj": ("mlp.gate_up_proj", 0),
            "up_proj": ("mlp.gate_up_proj", 1),
        }
        for name, tensor in weights:
            if progress is not None:
                progress(name)
            if "rotary_emb" in name:
                continue
            name = name.removeprefix("model.")
            parts = name.split(".")
            if len(parts) >= 5 and parts[0] == "layers" and parts[3] in fused:
                target, shard = fused[parts[3]]
                full = f"layers.{parts[1]}.{target}.{parts[4]}"
                self._load_shard(params[full], tensor, parts[3], shard)
                filled.add(f"{full}#{shard}")
                continue
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            if name not in params:
                raise ValueError(f"unexpected weight {name!r} in checkpoint")
            param = params[name]
            if param.shape != tensor.shape:
                raise ValueError(
                    f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(param.shape)}"
                )
            param.data.copy_(tensor)
            filled.add(name)
        missing = [n for n in params if n not in filled and not self._fused_complete(n, filled)]
        if self.tie_word_embeddings:
            missing = [n for n in missing if n != "lm_head.weight"]
        if missing:
            raise ValueError(f"checkpoint is missing weights: {missing[:5]}")

    @property
    def first_attention(self) -> Attention:
        return cast(DecoderLayer, self.layers[0]).self_attn

    def _load_shard(self, param: torch.Tensor, tensor: torch.Tensor, proj: str, shard: int) -> None:
        attn = self.first_attention
        if proj in ("q_proj", "k_proj", "v_proj"):
            sizes = [attn.q_size, attn.kv_size, attn.kv_size]
        else:
            sizes = [self.config.intermediate_size] * 2
        start = sum(sizes[:shard])
        if tensor.shape[0] != sizes[shard]:
            raise ValueError(
                f"{proj}: checkpoint rows {tensor.shape[0]} != expected {sizes[shard]}"
            )
        param.data[start : start + sizes[shard]].copy_(tensor)

    @staticmethod
    def _fused_complete(name: str, filled: set[str]) -> bool:
        shards = 3 if "qkv_proj" in name else 2 if "gate_up_proj" in name else 0
        return shards > 0 and all(f"{name}#{i}" in filled for i in range(shards))


def weight_names(model_dir: Path) -> list[str]:
    names: list[str] = []
    for file in safetensors_files(model_dir):
        with safe_open(str(file), framework="pt") as f:
            names.extend(f.keys())
    return names


def parameter_count(model_dir: Path) -> int:
    """Elements in a checkpoint, from its headers (nothing read but them)."""
    count = 0
    for file in safetensors_files(model_dir):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                count += math.prod(f.get_slice(key).get_shape())
    return count


def iter_safetensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield every tensor of a single-file or sharded safetensors checkpoint: from its mapping
    made ahead (engine.checkpoints.checkpoint_map), else read now."""
    mapped = checkpoint_map.take(model_dir)
    if mapped is not None:
        for tensors in mapped:
            yield from tensors.items()
        return
    for file in safetensors_files(model_dir):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield key, f.get_tensor(key)


def eos_token_ids(hf_config: Any, tokenizer: Any, model_dir: str) -> frozenset[int]:
    """The token ids that end a sequence: the generation config's, else the model config's,
    else the tokenizer's."""
    ids: set[int] = set()
    try:
        from transformers import GenerationConfig

        gen = GenerationConfig.from_pretrained(model_dir)
        eos = gen.eos_token_id
    except OSError:
        eos = getattr(hf_config, "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    if isinstance(eos, int):
        ids.add(eos)
    elif eos is not None:
        ids.update(int(e) for e in eos)
    return frozenset(ids)
