"""Task sources with verifiers, as a Dagster resource (the pure code is ``flow_assets.tasks``)."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from dagster import ConfigurableResource
from pydantic import Field

from flow_assets.tasks.sources import JsonlSource, JsonlSourceConfig, ReasoningGymSource, ReasoningGymSourceConfig


@lru_cache(maxsize=8)
def _reasoning_gym(name: str, size: int, seed: int, config_items: tuple, held_out_percent: int) -> ReasoningGymSource:
    # generating the dataset costs seconds; every asset of a round asks for the same one
    return ReasoningGymSource(
        ReasoningGymSourceConfig(
            name=name, size=size, seed=seed, dataset_config=dict(config_items), held_out_percent=held_out_percent
        )
    )


class TaskSourceResource(ConfigurableResource):
    """Where training and held-out tasks come from.

    Attributes:
        kind: ``"reasoning_gym"`` (a generated dataset) or ``"jsonl"`` (a file of
            ``{task_id, query, reference}`` lines scored by ``verifier``).
        name / dataset_config / size / seed: the reasoning-gym dataset (default ``spell_backward``
            with 3-5 letter words).
        path / verifier: the JSONL file and its verifier (``exact``, ``exact_ci``, ``contains``).
        held_out_percent: share of task ids (by sha256) in the held-out split.
    """

    kind: str = Field("reasoning_gym", description="'reasoning_gym' or 'jsonl'")
    name: str = Field("spell_backward", description="reasoning-gym dataset name")
    dataset_config: dict[str, Any] = Field(
        default_factory=lambda: {"min_word_len": 3, "max_word_len": 5}, description="reasoning-gym config"
    )
    size: int = Field(4000, description="tasks generated (before de-duplication)")
    seed: int = Field(0, description="dataset seed")
    path: str | None = Field(None, description="JSONL task file for kind='jsonl'")
    verifier: str = Field("exact", description="verifier for kind='jsonl'")
    held_out_percent: int = Field(20, description="held-out share of task ids, percent")

    def source(self) -> ReasoningGymSource | JsonlSource:
        """The task source this configuration describes.

        Raises:
            ValueError: unknown ``kind``, or ``kind='jsonl'`` without ``path``.
        """
        if self.kind == "reasoning_gym":
            return _reasoning_gym(
                self.name, self.size, self.seed, tuple(sorted(self.dataset_config.items())), self.held_out_percent
            )
        if self.kind == "jsonl":
            if not self.path:
                raise ValueError("task source kind 'jsonl' needs a path")
            return JsonlSource(JsonlSourceConfig(path=self.path, verifier=self.verifier, held_out_percent=self.held_out_percent))
        raise ValueError(f"unknown task source kind {self.kind!r} (expected 'reasoning_gym' or 'jsonl')")

    @property
    def agent_id(self) -> str:
        """The agent id written on rollouts of the trainable policy for this task source."""
        return f"flowopt:{self.name if self.kind == 'reasoning_gym' else 'jsonl'}"
