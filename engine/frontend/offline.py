"""Offline batch generation, as vLLM's `LLM`: `LLM(model=...).generate(prompts, params)` runs
every prompt to completion on an LLMEngine of its own, no server, no event loop."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.lora.types import LoRALoader, LoRARequest
from engine.messages import EngineRequest
from engine.model_runner import ProgressFn
from engine.outputs import CompletionOutput, RequestOutput
from engine.request import SamplingParams


class LLM:
    """Offline batch generation: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

    def __init__(
        self,
        model: str,
        progress: ProgressFn | None = None,
        lora_loader: LoRALoader | None = None,
        **kwargs: Any,
    ) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs), progress, lora_loader)
        self._next_id = 0

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def chat_prompt(self, message: str) -> list[int]:
        """The token ids of one user message through the model's chat template, ending
        where the assistant's answer starts."""
        encoded = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": message}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
        )
        return list(encoded["input_ids"])

    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]] | str,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        cache_salt: str | None = None,
        on_step: Callable[[int], None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; results in prompt order.

        `on_step(num_finished)` is called after each step (progress bars)."""
        prompt_list: list[str | Sequence[int]] = (
            [prompts] if isinstance(prompts, str) else list(prompts)
        )
        if sampling_params is None:
            sampling_params = SamplingParams()
        params_list = (
            [sampling_params] * len(prompt_list)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params_list) != len(prompt_list):
            raise ValueError("one SamplingParams per prompt, or one for all")
        loras = (
            [lora_request] * len(prompt_list)
            if lora_request is None or isinstance(lora_request, LoRARequest)
            else list(lora_request)
        )
        if len(loras) != len(prompt_list):
            raise ValueError("one LoRARequest per prompt, or one for all")
        results: dict[str, RequestOutput] = {}
        order = []
        for prompt, params, lora in zip(prompt_list, params_list, loras, strict=True):
            request_id = str(self._next_id)
            self._next_id += 1
            prompt_ids = self.engine.add(
                EngineRequest(request_id, prompt, params, lora, cache_salt)
            )
            results[request_id] = RequestOutput(
                request_id, prompt_ids, [CompletionOutput(i) for i in range(params.n)]
            )
            order.append(request_id)
        num_finished = 0
        while self.engine.has_unfinished_requests():
            for update in self.engine.step():
                results[update.request_id].apply(update)
                num_finished += update.finished
            if on_step is not None:
                on_step(num_finished)
        return [results[r] for r in order]
