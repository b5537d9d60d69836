"""A gateway over a policy's models directory: the serving side of :class:`PolicyStore`.

The store (``flow_assets.policy.store``) only knows the directory layout and how to load a model;
this module builds the gateway on top of it, so the policy domain never imports the gateway.
"""

from __future__ import annotations

from pathlib import Path

from flow_assets.serving.gateway.app import Gateway, GatewayConfig
from flow_assets.serving.gateway.engine import AdapterRef, AdapterResolver, PolicyEngine
from flow_assets.serving.gateway.server import GatewayServer
from flow_assets.policy.store import PolicyStore


def make_gateway(
    store: PolicyStore,
    landing_dir: str | Path,
    extra: dict[str, AdapterRef] | None = None,
    config: GatewayConfig | None = None,
    dtype: str | None = None,
) -> Gateway:
    """A gateway over ``store``'s policy (not yet serving). ``extra`` serves adapters by name
    besides the registry's; the default config caps completions at ``store.max_new_tokens`` tokens.
    ``dtype``: the weights' precision with the transformers backend (:class:`PolicyEngine`;
    ``None`` = as saved); the vLLM backend serves in its own precision and ignores it.

    Raises:
        OSError: the base model cannot be loaded.
        ValueError: a bad ``dtype`` (:class:`PolicyEngine`).
    """
    engine = PolicyEngine(store.base_path, backend=store.backend, max_lora_rank=store.lora_rank,
                          dtype=dtype if store.backend == "transformers" else None)
    config = config or GatewayConfig(default_max_tokens=store.max_new_tokens)
    return Gateway(engine, AdapterResolver(store.registry_path, extra), landing_dir, config)


def serve_policy(
    store: PolicyStore,
    landing_dir: str | Path,
    extra: dict[str, AdapterRef] | None = None,
    config: GatewayConfig | None = None,
    port: int = 0,
    dtype: str | None = None,
) -> GatewayServer:
    """:func:`make_gateway` serving HTTP on 127.0.0.1 from a background thread (a context
    manager; ``port=0`` picks a free port).

    Raises:
        OSError: the base model cannot be loaded.
        ValueError: a bad ``dtype`` (:class:`PolicyEngine`).
    """
    return GatewayServer(make_gateway(store, landing_dir, extra, config, dtype), port=port)
