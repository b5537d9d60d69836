"""The policy model: a causal LM from a local path plus LoRA adapters, sampled with log-probs."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from dagster import ConfigurableResource
from pydantic import Field

from flow_assets.policy.lora import LoraAdapterConfig, add_lora_adapter, load_lora_adapter
from flow_assets.policy.sampling import Rollout, SamplingConfig, sample_rollouts
from flow_assets.policy.tiny_model import load_policy


@lru_cache(maxsize=2)
def _vllm_sampler(base_path: str, max_lora_rank: int):
    # one engine per process and base model: starting vLLM costs tens of seconds
    from flow_assets.policy.vllm_backend import VLLMSampler

    return VLLMSampler(base_path, max_lora_rank=max_lora_rank)


class PolicyModel(ConfigurableResource):
    """Loads the base policy through ``from_pretrained`` and its LoRA adapters through PEFT.

    Attributes:
        models_root: directory of the base model (``<root>/base``), adapters and checkpoints.
        base_model_path: a user's own model directory (any causal LM with its tokenizer); when
            unset, ``base_policy`` builds the tiny demo model into ``<root>/base``.
        backend: ``"transformers"`` (CPU or GPU) or ``"vllm"`` (GPU, optional ``gpu`` extra) for
            rollouts; training always uses transformers + PEFT.
        lora_rank / lora_alpha: shape of new adapters.
        max_new_tokens: completion length cap, tokens.
    """

    models_root: str = Field(".models", description="Directory for base model, adapters, checkpoints.")
    base_model_path: str | None = Field(None, description="A local causal LM to train instead of the tiny model.")
    backend: str = Field("transformers", description="'transformers' or 'vllm'")
    lora_rank: int = Field(16, description="LoRA rank of new adapters")
    lora_alpha: float = Field(32.0, description="LoRA alpha of new adapters")
    max_new_tokens: int = Field(8, description="completion length cap, tokens")

    @property
    def base_path(self) -> Path:
        """Directory of the base model (the user's, else the tiny one)."""
        return Path(self.base_model_path) if self.base_model_path else Path(self.models_root) / "base"

    def adapter_dir(self, name: str) -> Path:
        """Directory for the adapter called ``name``."""
        return Path(self.models_root) / "adapters" / name

    def load(self, adapter_path: str | None = None, trainable: bool = False):
        """``(model, tokenizer)``: the base model, with the adapter at ``adapter_path`` if given.

        Raises:
            OSError: the base model or adapter directory is missing or unreadable.
        """
        model, tokenizer = load_policy(self.base_path)
        if adapter_path is None:
            return model, tokenizer
        return load_lora_adapter(model, adapter_path, trainable=trainable), tokenizer

    def new_adapter(self, model):
        """Wrap ``model`` in a fresh LoRA adapter (B = 0, so it starts as the identity)."""
        return add_lora_adapter(model, LoraAdapterConfig(rank=self.lora_rank, alpha=self.lora_alpha))

    def sample(
        self,
        prompts: list[str],
        config: SamplingConfig,
        adapter_path: str | None = None,
        loaded=None,
    ) -> list[Rollout]:
        """Rollouts of ``prompts`` by the base model + adapter, with behaviour log-probs.

        ``loaded`` is an already loaded ``(model, tokenizer)`` to reuse (transformers backend).

        Raises:
            ValueError: unknown backend.
        """
        if self.backend == "vllm":
            return _vllm_sampler(str(self.base_path), self.lora_rank).sample(prompts, config, adapter_path)
        if self.backend != "transformers":
            raise ValueError(f"unknown policy backend {self.backend!r} (expected 'transformers' or 'vllm')")
        model, tokenizer = loaded or self.load(adapter_path)
        return sample_rollouts(model, tokenizer, prompts, config)
