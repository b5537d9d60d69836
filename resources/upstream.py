"""The upstream model of an agent flowopt does not host: where a prompt round sends its calls."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dagster import ConfigurableResource
from pydantic import Field

if TYPE_CHECKING:  # the HTTP client only where an upstream is called: the code location loads this module
    from flow_assets.serving.gateway.upstream import Upstream


class UpstreamModel(ConfigurableResource):
    """The OpenAI-compatible model server behind ``flowopt serve --upstream`` (a hosted API, vLLM,
    llama.cpp's server), for the prompt rounds' search and gate calls.

    Attributes:
        base_url: its URL up to ``/v1`` [FLOWOPT_UPSTREAM_URL]; empty (default): no upstream, so
            no prompt round runs and ``prompt_round_sensor`` requests none.
        model: the model name sent upstream [FLOWOPT_UPSTREAM_MODEL]; empty: the served name.
        api_key: its bearer key [FLOWOPT_UPSTREAM_API_KEY]: an ``EnvVar`` in the code location, so
            Dagster reads it when the resource is used and never stores or shows it.
        timeout_s: seconds one upstream call may take.
    """

    base_url: str = Field("", description="the upstream's URL up to /v1; empty: no prompt rounds")
    model: str = Field("", description="the model name sent upstream; empty: the name the agent asked for")
    api_key: str = Field("", description="the upstream's bearer key (from FLOWOPT_UPSTREAM_API_KEY)")
    timeout_s: float = Field(600.0, gt=0, description="seconds one upstream call may take")

    @property
    def enabled(self) -> bool:
        """Whether an upstream is configured."""
        return bool(self.base_url)

    def upstream(self) -> Upstream:
        """The gateway's :class:`~flow_assets.serving.gateway.upstream.Upstream` for it.

        Raises:
            ValueError: no ``base_url``, or one that is not an http(s) URL.
        """
        if not self.base_url:
            raise ValueError("no upstream model is configured (FLOWOPT_UPSTREAM_URL)")
        from flow_assets.serving.gateway.upstream import Upstream

        return Upstream(self.base_url, self.model or None, self.api_key or None, timeout_s=self.timeout_s)


class ReflectionEndpoint(ConfigurableResource):
    """The reflection model of the prompt rounds' GEPA rewriting: any OpenAI-compatible chat
    endpoint, configured like the judge.

    Attributes:
        base_url: up to ``/v1`` [FLOWOPT_REFLECTION_URL]; empty (default): no reflective rewriting.
        model: the model name sent [FLOWOPT_REFLECTION_MODEL].
        api_key: its bearer key [FLOWOPT_REFLECTION_API_KEY], an ``EnvVar`` in the code location.
        max_tokens / temperature: of each reflection call.
    """

    base_url: str = Field("", description="the reflection model's URL up to /v1; empty: no reflective rewriting")
    model: str = Field("", description="the reflection model's name")
    api_key: str = Field("", description="its bearer key (from FLOWOPT_REFLECTION_API_KEY)")
    max_tokens: int = Field(512, ge=1, description="tokens per reflection reply")
    temperature: float = Field(1.0, ge=0.0, description="sampling temperature of the reflection model")

    @property
    def enabled(self) -> bool:
        """Whether a reflection model is configured."""
        return bool(self.base_url)

    def client(self):
        """A :class:`~flow_assets.training.prompt_reflection.ReflectionModel` for it (its own counters).

        Raises:
            ValueError: no ``base_url``, or one that is not an http(s) URL.
        """
        from flow_assets.training.prompt_reflection import ReflectionModel

        if not self.base_url:
            raise ValueError("no reflection model is configured (FLOWOPT_REFLECTION_URL)")
        return ReflectionModel(self.base_url, self.model, self.api_key or None, self.max_tokens, self.temperature)
