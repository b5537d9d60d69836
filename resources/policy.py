"""The policy model as a Dagster resource: a thin wrapper of :class:`~flow_assets.policy.store.PolicyStore`."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from dagster import ConfigurableResource
from pydantic import Field

from flow_assets.policy.configs import ROUND_MAX_NEW_TOKENS
from flow_assets.policy.store import PolicyStore
from flow_assets.settings import DEFAULT_MODELS


class PolicyModel(ConfigurableResource):
    """Loads the base policy through ``from_pretrained`` and its LoRA adapters through PEFT, and
    serves them through the gateway.

    Attributes:
        models_root: directory of the base model (``<root>/base``), adapters, rounds and registry.
        base_model_path: a user's own model directory (any causal LM with its tokenizer and a chat
            template); when unset, ``base_policy`` builds the tiny demo model into ``<root>/base``.
        backend: ``"transformers"`` (CPU or GPU) or ``"vllm"`` (GPU, optional ``gpu`` extra) for
            the gateway's sampling; training always uses transformers + PEFT.
        lora_rank / lora_alpha: shape of new adapters.
        max_new_tokens: the gateway's completion cap for calls that set none, tokens.
    """

    models_root: str = Field(DEFAULT_MODELS, description="Directory for base model, adapters, rounds, registry.")
    base_model_path: str | None = Field(None, description="A local causal LM to train instead of the tiny model.")
    backend: Literal["transformers", "vllm"] = Field("transformers", description="the gateway's sampling backend")
    lora_rank: int = Field(16, description="LoRA rank of new adapters")
    lora_alpha: float = Field(32.0, description="LoRA alpha of new adapters")
    max_new_tokens: int = Field(ROUND_MAX_NEW_TOKENS, description="completion cap for calls that set none, tokens")

    def store(self) -> PolicyStore:
        """The pure description of this policy's directory."""
        return PolicyStore(
            self.models_root, self.base_model_path, self.lora_rank, self.lora_alpha, self.max_new_tokens, self.backend
        )

    @property
    def base_path(self) -> Path:
        """Directory of the base model (the user's, else the tiny one)."""
        return self.store().base_path

    def adapter_dir(self, name: str) -> Path:
        """Directory for the adapter called ``name``."""
        return self.store().adapter_dir(name)

    def load(self, adapter_path: str | None = None, trainable: bool = False):
        """``(model, tokenizer)``; see :meth:`PolicyStore.load`."""
        return self.store().load(adapter_path, trainable)

    def new_adapter(self, model):
        """A fresh identity LoRA adapter on ``model``; see :meth:`PolicyStore.new_adapter`."""
        return self.store().new_adapter(model)
