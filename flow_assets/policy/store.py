"""Where a policy lives on disk.

A policy's models directory holds its base model (``base/``, unless the user's own model lives
elsewhere), its LoRA adapters (``adapters/<version>/``), the rounds' files (``runs/<batch>/``) and
the registry (``registry.json``). :class:`PolicyStore` is that layout plus how to load from it;
the Dagster resource :class:`resources.policy.PolicyModel` wraps one, and
:mod:`flow_assets.serving.gateway.serve` serves one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from flow_assets.policy.configs import ROUND_MAX_NEW_TOKENS
from flow_assets.settings import DEFAULT_MODELS


@dataclass(frozen=True)
class PolicyStore:
    """A policy's models directory.

    Attributes:
        models_root: the directory (base model, adapters, rounds, registry).
        base_model_path: the user's own base model directory; ``None`` = ``<models_root>/base``.
        lora_rank / lora_alpha: shape of new adapters.
        max_new_tokens: the gateway's completion cap for calls that set none, tokens
            (:data:`~flow_assets.policy.configs.ROUND_MAX_NEW_TOKENS` by default).
        backend: ``"transformers"`` (CPU or GPU) or ``"vllm"`` (GPU) for the gateway's sampling.
    """

    models_root: str = DEFAULT_MODELS
    base_model_path: str | None = None
    lora_rank: int = 16
    lora_alpha: float = 32.0
    max_new_tokens: int = ROUND_MAX_NEW_TOKENS
    backend: str = "transformers"

    @property
    def base_path(self) -> Path:
        """Directory of the base model (the user's, else the tiny one)."""
        return Path(self.base_model_path) if self.base_model_path else Path(self.models_root) / "base"

    @property
    def registry_path(self) -> Path:
        """The registry file."""
        return Path(self.models_root) / "registry.json"

    def adapter_dir(self, name: str) -> Path:
        """Directory for the adapter called ``name``."""
        return Path(self.models_root) / "adapters" / name

    def round_dir(self, batch: str) -> Path:
        """Directory of the training round on ``batch`` (checkpoints, candidate, its files)."""
        return Path(self.models_root) / "runs" / batch

    def load(self, adapter_path: str | None = None, trainable: bool = False):
        """``(model, tokenizer)``: the base model, with the adapter at ``adapter_path`` if given.

        Raises:
            OSError: the base model or adapter directory is missing or unreadable.
        """
        # torch, transformers and peft load here, not with the module: the code location imports
        # this module, and most of its runs never load a model
        from flow_assets.policy.lora import load_lora_adapter
        from flow_assets.policy.tiny_model import load_policy

        model, tokenizer = load_policy(self.base_path)
        if adapter_path is None:
            return model, tokenizer
        return load_lora_adapter(model, adapter_path, trainable=trainable), tokenizer

    def new_adapter(self, model):
        """Wrap ``model`` in a fresh LoRA adapter (B = 0, so it starts as the identity)."""
        from flow_assets.policy.lora import LoraAdapterConfig, add_lora_adapter

        return add_lora_adapter(model, LoraAdapterConfig(rank=self.lora_rank, alpha=self.lora_alpha))
