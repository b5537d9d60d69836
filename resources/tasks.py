"""Task sources with verifiers, and the agent that works on them, as a Dagster resource (the
pure code is ``flow_assets.tasks`` and ``flow_assets.serving.agents``)."""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING, Any, Literal

from dagster import ConfigurableResource
from pydantic import Field

from flow_assets.serving.agents.harness import AgentFn, load_agent
from flow_assets.tasks.calculator import CalculatorSource, CalculatorSourceConfig
from flow_assets.tasks.word_problems import WordProblemSource, WordProblemSourceConfig
from flow_assets.tasks.sources import JsonlSource, JsonlSourceConfig, ReasoningGymSource, ReasoningGymSourceConfig

if TYPE_CHECKING:
    from flow_assets.tasks.bfcl import BfclSource

#: the built-in agent of each kind of task source
DEFAULT_AGENTS = {
    "reasoning_gym": "flow_assets.serving.agents.builtin:one_turn_agent",
    "jsonl": "flow_assets.serving.agents.builtin:one_turn_agent",
    "calculator": "flow_assets.serving.agents.builtin:calculator_agent",
    "word_problems": "flow_assets.serving.agents.builtin:word_problem_agent",
    "bfcl": "flow_assets.serving.agents.builtin:bfcl_agent",
}


@lru_cache(maxsize=8)
def _reasoning_gym(name: str, size: int, seed: int, config_items: tuple, held_out_percent: int) -> ReasoningGymSource:
    # generating the dataset costs seconds; every asset of a round asks for the same one
    return ReasoningGymSource(
        ReasoningGymSourceConfig(
            name=name, size=size, seed=seed, dataset_config=dict(config_items), held_out_percent=held_out_percent
        )
    )


@lru_cache(maxsize=8)
def _word_problems(seed: int, held_out_percent: int) -> WordProblemSource:
    return WordProblemSource(WordProblemSourceConfig(seed=seed, held_out_percent=held_out_percent))


@lru_cache(maxsize=8)
def _bfcl(held_out_percent: int):
    # bfcl-eval is an optional extra: imported only when this kind is asked for
    from flow_assets.tasks.bfcl import BfclSource, BfclSourceConfig

    return BfclSource(BfclSourceConfig(held_out_percent=held_out_percent))


@lru_cache(maxsize=8)
def _calculator(size: int, seed: int, held_out_percent: int) -> CalculatorSource:
    return CalculatorSource(CalculatorSourceConfig(size=size, seed=seed, held_out_percent=held_out_percent))


class TaskSourceResource(ConfigurableResource):
    """Where training and held-out tasks come from, and which agent works on them.

    Attributes:
        kind: ``"reasoning_gym"`` (a generated dataset, one-turn), ``"jsonl"`` (a file of
            ``{task_id, query, reference}`` lines scored by ``verifier``, one-turn) or
            ``"calculator"`` (the built-in multi-turn tool-using task) or ``"word_problems"``
            (arithmetic stories, a calculator and worked examples: the real-model task) or ``"bfcl"``
            (BFCL v4's non-live AST questions, each with its own tools, scored by BFCL's checker;
            needs ``make install-bfcl``).
        name / dataset_config / size / seed: the reasoning-gym dataset (default ``spell_backward``
            with 3-5 letter words); ``size`` and ``seed`` also generate the calculator tasks.
        path / verifier: the JSONL file and its verifier (``exact``, ``exact_ci``, ``contains``).
        held_out_percent: share of task ids (by sha256) in the held-out split (``None``: 20, and
            30 for ``bfcl``, the split :mod:`flow_assets.tasks.bfcl` documents).
        agent: the agent as ``module:function`` (an ``async`` function ``agent(client, task)``);
            default: the built-in agent of ``kind``.
    """

    kind: Literal["reasoning_gym", "jsonl", "calculator", "word_problems", "bfcl"] = Field("reasoning_gym", description="task source kind")
    name: str = Field("spell_backward", description="reasoning-gym dataset name")
    dataset_config: dict[str, Any] = Field(
        default_factory=lambda: {"min_word_len": 3, "max_word_len": 5}, description="reasoning-gym config"
    )
    size: int = Field(4000, description="tasks generated (before de-duplication)")
    seed: int = Field(0, description="dataset seed")
    path: str | None = Field(None, description="JSONL task file for kind='jsonl'")
    verifier: str = Field("exact", description="verifier for kind='jsonl'")
    held_out_percent: int | None = Field(None, description="held-out share of task ids, percent (default 20; 30 for bfcl)")
    agent: str | None = Field(None, description="the agent, module:function; default: the kind's built-in agent")

    def source(self) -> ReasoningGymSource | JsonlSource | CalculatorSource | WordProblemSource | BfclSource:
        """The task source this configuration describes.

        Raises:
            ValueError: ``kind='jsonl'`` without ``path``.
            BfclUnavailable: ``kind='bfcl'`` without bfcl-eval installed (``make install-bfcl``).
        """
        held_out = self.held_out_percent if self.held_out_percent is not None else (30 if self.kind == "bfcl" else 20)
        if self.kind == "reasoning_gym":
            return _reasoning_gym(self.name, self.size, self.seed, tuple(sorted(self.dataset_config.items())), held_out)
        if self.kind == "calculator":
            return _calculator(self.size, self.seed, held_out)
        if self.kind == "word_problems":
            return _word_problems(self.seed, held_out)
        if self.kind == "bfcl":
            return _bfcl(held_out)
        if not self.path:
            raise ValueError("task source kind 'jsonl' needs a path")
        return JsonlSource(JsonlSourceConfig(path=self.path, verifier=self.verifier, held_out_percent=held_out))

    def agent_fn(self) -> AgentFn:
        """The agent function.

        Raises:
            AgentLoadError: ``agent`` does not name an async ``agent(client, task)``.
        """
        return load_agent(self.agent or DEFAULT_AGENTS[self.kind])

    @property
    def agent_id(self) -> str:
        """The agent id written on rollouts of the trainable policy for this task source."""
        return {
            "reasoning_gym": f"flowopt:{self.name}", "jsonl": "flowopt:jsonl", "calculator": "flowopt:calculator",
            "word_problems": "flowopt:word_problems", "bfcl": "flowopt:bfcl",
        }[self.kind]  # fmt: skip
