"""The scoring agent's endpoint: an LLM judge behind any OpenAI-compatible API (a hosted model, a
vLLM server, or ``flowopt serve``), configured by URL, model and a key from the environment."""

from __future__ import annotations

from dagster import ConfigurableResource
from pydantic import Field

from flow_assets.judge.client import DEFAULT_RUBRIC, MODES, JudgeCache, JudgeSettings
from flow_assets.settings import DEFAULT_JUDGE_CACHE


class JudgeEndpoint(ConfigurableResource):
    """Where and how the ``rewards`` asset asks its judge (:mod:`flow_assets.judge.client`).

    Off by default (``base_url`` empty): rewards come from logged outcomes, shaping terms and
    custom functions only. In a deployment set ``FLOWOPT_JUDGE_URL``, ``FLOWOPT_JUDGE_MODEL`` and,
    for an endpoint that needs one, ``FLOWOPT_JUDGE_API_KEY`` (read through Dagster's ``EnvVar``,
    so the key never appears in run config or the UI).
    """

    base_url: str = Field("", description="OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1; empty = no judge")
    model: str = Field("", description="the judge's model name at that endpoint")
    api_key: str = Field("unused", description="bearer key; set it with EnvVar('FLOWOPT_JUDGE_API_KEY'), as the code location does")
    mode: str = Field("relative", description=f"one of {MODES}: a 0-1 score per trajectory, or each group ranked (RULER)")
    rubric: str = Field(DEFAULT_RUBRIC, description="what a good trajectory is, in your words")
    concurrency: int = Field(8, ge=1, description="requests in flight at once")
    timeout_s: float = Field(60.0, gt=0, description="per request, seconds")
    max_retries: int = Field(2, ge=0, description="retries of a failed request (exponential backoff)")
    temperature: float = Field(0.0, ge=0.0, description="sampling temperature of the judge's reply (0 = greedy)")
    max_tokens: int = Field(256, ge=1, description="longest reply, tokens")
    input_usd_per_mtok: float = Field(0.0, ge=0.0, description="price of prompt tokens, USD per million")
    output_usd_per_mtok: float = Field(0.0, ge=0.0, description="price of completion tokens, USD per million")
    cache_dir: str = Field(DEFAULT_JUDGE_CACHE, description="replies cached by content hash; empty = no cache")

    @property
    def enabled(self) -> bool:
        """Whether a judge is configured."""
        return bool(self.base_url)

    def settings(self) -> JudgeSettings:
        """The pure settings.

        Raises:
            ValueError: ``model`` is empty while ``base_url`` is set, or a bad mode.
        """
        if not self.model:
            raise ValueError("the judge endpoint has a base_url but no model (set FLOWOPT_JUDGE_MODEL)")
        return JudgeSettings(
            model=self.model, mode=self.mode, rubric=self.rubric, temperature=self.temperature, max_tokens=self.max_tokens,
            concurrency=self.concurrency, timeout_s=self.timeout_s, max_retries=self.max_retries,
            input_usd_per_mtok=self.input_usd_per_mtok, output_usd_per_mtok=self.output_usd_per_mtok,
        )  # fmt: skip

    def cache(self) -> JudgeCache:
        """The reply cache."""
        return JudgeCache(self.cache_dir or None)
