"""The policy behind the gateway: one base model, LoRA adapters by name, sampled from token ids.

The base model is loaded once (``from_pretrained``, as everywhere in flowopt); every adapter the
gateway is asked for is loaded onto it with PEFT under its own name, and a generation call
activates the one it needs. So champion, challenger and any registry version share one copy of
the base weights, however many of them are served.

Model names (the ``model`` field of a request) resolve through :class:`AdapterResolver`:

    policy, champion   the registry's champion
    candidate          the adapter the latest training round produced (registry ``candidate``)
    v0, v1, ...        a version in the registry's history
    any name in ``extra``   adapters a caller serves without registering them (the held-out
                            evaluation serves a round's candidate this way)
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from flow_assets.policy.chat import ChatFormat, chat_format

if TYPE_CHECKING:  # annotations only: peft and torch cost seconds in every process that loads the code location
    from peft import PeftModel

    from flow_assets.policy.configs import Rollout, SamplingConfig


class UnknownModelError(KeyError):
    """A request named a model (adapter) the gateway does not serve; the message lists those it does."""

    def __str__(self) -> str:
        return str(self.args[0])


@dataclass(frozen=True)
class AdapterRef:
    """A resolved model name: the registry ``version`` that answers (``"candidate"`` for an
    unregistered one) and its adapter directory."""

    version: str
    path: str


def in_challenger_share(session: str, challenger: Mapping) -> bool:
    """Whether live session ``session`` is served by ``challenger`` (a registry challenger entry
    with ``version`` and ``share``): the first 8 bytes of sha256(version + NUL + session) as a
    fraction of 2^64 below ``share``. Stable for a session for the whole A/B (every turn of a
    conversation gets the same adapter), independent across challengers (a new A/B draws new
    sessions), and uniform, so the challenger's share of sessions is ``share`` in expectation."""
    digest = hashlib.sha256(f"{challenger['version']}\0{session}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64 < float(challenger["share"])


class AdapterResolver:
    """Model name -> adapter, from the registry file (re-read when it changes) and ``extra``.

    Args:
        registry_path: ``registry.json`` of the policy's models directory (it may not exist yet).
        extra: name -> :class:`AdapterRef` served in addition (they take precedence).
    """

    def __init__(self, registry_path: str | Path, extra: Mapping[str, AdapterRef] | None = None):
        self.registry_path = Path(registry_path)
        self.extra = dict(extra or {})
        self._cache: tuple[float, dict] | None = None
        self._lock = threading.Lock()

    def _registry(self) -> dict:
        with self._lock:
            try:
                mtime = self.registry_path.stat().st_mtime_ns
            except FileNotFoundError:
                return {"champion": None, "history": []}
            if self._cache is None or self._cache[0] != mtime:
                self._cache = (mtime, json.loads(self.registry_path.read_text()))
            return self._cache[1]

    def names(self) -> list[str]:
        """Every model name that resolves now, in a stable order."""
        registry = self._registry()
        names = ["policy", "champion"] if registry.get("champion") else []
        if registry.get("challenger"):
            names.append("challenger")
        if registry.get("candidate"):
            names.append("candidate")
        versions = {e["version"] for e in registry.get("history", [])}
        names += sorted(versions, key=lambda v: (len(v), v))
        return list(dict.fromkeys([*self.extra, *names]))

    def resolve(self, name: str, session: str | None = None) -> AdapterRef:
        """The adapter ``name`` refers to. ``policy`` is the champion, or, while a challenger is
        in live A/B, the challenger for the sessions :func:`in_challenger_share` puts in its
        share (``session``: the caller's session key; ``None`` is never split, it gets the
        champion). ``champion`` / ``challenger`` name each side explicitly.

        Raises:
            UnknownModelError: no such name (no champion yet, no candidate, unknown version).
        """
        if name in self.extra:
            return self.extra[name]
        registry = self._registry()
        challenger = registry.get("challenger")
        if challenger and (name == "challenger" or (name == "policy" and session is not None and in_challenger_share(session, challenger))):
            return AdapterRef(challenger["version"], challenger["adapter_path"])
        if name in ("policy", "champion") and registry.get("champion"):
            champ = registry["champion"]
            return AdapterRef(champ["version"], champ["adapter_path"])
        if name == "candidate" and registry.get("candidate"):
            return AdapterRef("candidate", registry["candidate"]["adapter_path"])
        for event in reversed(registry.get("history", [])):
            if event["version"] == name:
                return AdapterRef(name, event["adapter_path"])
        served = ", ".join(self.names()) or "none (no champion registered yet)"
        raise UnknownModelError(f"The model '{name}' does not exist; this gateway serves: {served}")


def _is_identity(model, name: str) -> bool:
    """Whether the LoRA adapter ``name`` of the PEFT ``model`` adds nothing: it holds only
    ``lora_A`` / ``lora_B`` weights (no DoRA magnitudes, biases or ``modules_to_save`` copies,
    which act even when ``B`` is zero) and every ``lora_B`` weight is zero, so ``B A x`` is
    exactly 0 (Hu et al. 2021 initialise ``B`` so)."""
    import torch

    mine = [(n, p) for n, p in model.named_parameters() if f".{name}." in n or n.endswith(f".{name}")]
    b = [p for n, p in mine if f".lora_B.{name}." in n]
    plain = all(f".lora_A.{name}." in n or f".lora_B.{name}." in n for n, _ in mine)
    return bool(b) and plain and all(not torch.any(w) for w in b)


class PolicyEngine:
    """The base model with its adapters, sampled from token ids (not thread-safe: the gateway
    calls it from its one batching thread).

    Args:
        base_path: the base model directory (``from_pretrained``).
        chat: how the chat template handles tools; ``None`` detects it
            (:func:`~flow_assets.policy.chat.chat_format`).
        max_adapters: adapters kept loaded; the least recently used one is unloaded beyond it.
        backend: ``"transformers"`` (in process, CPU or GPU) or ``"vllm"`` (GPU; the optional
            ``gpu`` extra): vLLM serves the adapters as LoRA requests, the tokenizer stays this one.
        max_lora_rank: the largest adapter rank vLLM must accept.
        dtype: the transformers backend's weight precision (``"float32"``, ``"bfloat16"``);
            ``None``: the model's saved one. Log-probs are computed from float32 logits either way.
            A lower precision is for evaluation (faster where the CPU has bfloat16 matrix units):
            rollouts that train must be sampled in the precision the trainer recomputes them in.

    Raises:
        OSError: the base model cannot be loaded.
        ValueError: unknown backend, a ``dtype`` that is not a floating-point torch dtype, or a
            ``dtype`` with the vLLM backend (which picks its own).
        ImportError: ``backend="vllm"`` without vLLM installed.
    """

    def __init__(
        self,
        base_path: str | Path,
        chat: ChatFormat | None = None,
        max_adapters: int = 8,
        backend: str = "transformers",
        max_lora_rank: int = 16,
        dtype: str | None = None,
    ):
        if backend not in ("transformers", "vllm"):
            raise ValueError(f"unknown policy backend {backend!r} (expected 'transformers' or 'vllm')")
        if backend == "vllm" and dtype is not None:
            raise ValueError(f"dtype={dtype!r} applies to the transformers backend only; vLLM picks its own precision")
        self.backend = backend
        self._vllm = None
        if backend == "vllm":
            from transformers import AutoConfig, AutoTokenizer

            from flow_assets.policy.vllm_backend import VLLMSampler

            self._vllm = VLLMSampler(str(base_path), max_lora_rank=max_lora_rank)
            # vLLM holds the weights; only the tokenizer and the config are needed here
            self.base, self.tokenizer = None, AutoTokenizer.from_pretrained(str(base_path))
            self.config = AutoConfig.from_pretrained(str(base_path))
        else:
            from flow_assets.policy.sampling import sample_token_ids
            from flow_assets.policy.tiny_model import load_policy

            self._sample_token_ids = sample_token_ids  # bound once: sample() runs on every call
            self.base, self.tokenizer = load_policy(base_path, dtype=dtype)
            self.config = self.base.config
        # the gateway checks prompt + completion against the model's positions itself (a 400 for
        # the client); the tokenizer's own length warning would only repeat it in the log
        self.tokenizer.model_max_length = int(1e30)
        self.model: PeftModel | None = None
        self.chat = chat or chat_format(self.tokenizer)
        self.max_adapters = max_adapters
        self._loaded: dict[str, str] = {}  # adapter path -> PEFT adapter name, least recently used first
        self._identity: set[str] = set()  # names of loaded adapters whose lora_B weights are all zero
        self._counter = 0

    @property
    def max_positions(self) -> int | None:
        """The model's context length in tokens (prompt + completion)."""
        return getattr(self.config, "max_position_embeddings", None)

    def activate(self, path: str) -> PeftModel:
        """The model with the adapter at ``path`` active (loaded on first use; the least recently
        used one unloaded beyond ``max_adapters``). Transformers backend only.

        Raises:
            OSError / ValueError: from PEFT, when the adapter directory is missing or does not fit
                the base model.
        """
        if path in self._loaded:
            name = self._loaded.pop(path)
            self._loaded[path] = name
        else:
            self._counter += 1
            name = f"adapter{self._counter}"
            if self.model is None:
                from peft import PeftModel

                self.model = PeftModel.from_pretrained(self.base, path, adapter_name=name, is_trainable=False)
            else:
                self.model.load_adapter(path, adapter_name=name, is_trainable=False)
            self._loaded[path] = name
            if _is_identity(self.model, name):
                self._identity.add(name)
            if len(self._loaded) > self.max_adapters:
                oldest = self._loaded.pop(next(iter(self._loaded)))
                self.model.delete_adapter(oldest)
                self._identity.discard(oldest)
        name = self._loaded[path]
        self.model.set_adapter(name)
        # an identity adapter (every lora_B zero, e.g. v0 of a fresh policy, the base model as it is)
        # adds exactly 0: its layers are skipped, which saves the LoRA matmuls of every forward
        if name in self._identity:
            self.model.base_model.disable_adapter_layers()
        else:
            self.model.base_model.enable_adapter_layers()
        return self.model

    def generate(
        self,
        adapter_path: str,
        prompt_ids: list[list[int]],
        config: SamplingConfig,
        temperatures: list[float] | None = None,
        top_ps: list[float] | None = None,
    ) -> list[Rollout]:
        """Sample ``config.num_samples`` completions per prompt with the adapter at ``adapter_path``;
        ``temperatures`` / ``top_ps`` give each prompt its own settings (one batch for all).

        Returns / raises: as :func:`~flow_assets.policy.sampling.sample_token_ids`; also
        ``OSError`` / ``ValueError`` from PEFT when the adapter directory is missing or does not
        fit the base model.
        """
        if self._vllm is not None:
            return self._vllm.generate(adapter_path, prompt_ids, config, temperatures, top_ps)
        return self._sample_token_ids(
            self.activate(adapter_path), self.tokenizer, prompt_ids, config, temperatures=temperatures, top_ps=top_ps
        )
