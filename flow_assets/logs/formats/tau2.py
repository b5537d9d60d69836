"""tau2-bench ``Results`` documents: ``{timestamp, info, tasks, simulations: [...]}``.

Each simulation is one record (pointer ``/simulations/<i>``); its ``messages`` are OpenAI-style
chat messages mapped to steps by :func:`.openai_chat.chat_to_steps`. A tool step fails when its
tool message says ``error: true``; exports that omit the flag altogether (the toolorchestra
submission) fall back to tau-bench's rule, a result text starting with ``"Error"``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from flow_assets.logs.records import display_path
from flow_assets.logs.formats.common import (
    DEFAULT_MAX_RECORD_BYTES,
    TaskId,
    RecordStream,
    empty_stream,
    load_document,
    stream_elements,
    require_document_shape,
)
from flow_assets.logs.formats.openai_chat import ChatMessage, chat_to_steps, prompt_fingerprint
from flow_assets.logs.schema import FiniteFloat, OptionalFiniteFloat, Outcome, Trajectory

FORMAT = "tau2"


class RewardInfo(BaseModel):
    """The part of ``reward_info`` the outcome needs."""

    model_config = ConfigDict(extra="ignore", strict=True)

    reward: FiniteFloat


class Simulation(BaseModel):
    """One tau2 simulation (one episode of the agent on one task)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    id: str = Field(min_length=1)
    task_id: TaskId = Field(min_length=1)
    trial: int | None = None
    seed: int | None = None
    reward_info: RewardInfo
    messages: list[ChatMessage]
    termination_reason: str | None = None
    agent_cost: OptionalFiniteFloat = None
    user_cost: OptionalFiniteFloat = None
    duration: OptionalFiniteFloat = Field(None, description="seconds")
    start_time: str | None = None
    timestamp: str | None = None


def _tool_failed(tool_message: ChatMessage) -> bool:
    if tool_message.error is not None:
        return tool_message.error
    return (tool_message.content or "").startswith("Error")


def _get(mapping: Any, *keys: str) -> Any:
    for key in keys:
        if not isinstance(mapping, dict):
            return None
        mapping = mapping.get(key)
    return mapping


def agent_id_of(info: Any, stem: str) -> str:
    """``"{implementation}:{llm}"`` from ``info.agent_info``, or the file stem when the
    document does not name its agent."""
    implementation = _get(info, "agent_info", "implementation")
    llm = _get(info, "agent_info", "llm")
    if isinstance(implementation, str) and isinstance(llm, str) and implementation and llm:
        return f"{implementation}:{llm}"
    return stem


def simulation_trajectory(sim: Simulation, agent_id: str, file_facts: dict[str, Any]) -> Trajectory:
    """The canonical trajectory of one simulation; ``file_facts`` (domain, user simulator,
    policy fingerprint) are copied into its metadata.

    Raises:
        pydantic.ValidationError: the result breaks the canonical schema.
    """
    episode = chat_to_steps(sim.messages, _tool_failed)
    metadata: dict[str, Any] = {
        "source_format": FORMAT,
        "trial": sim.trial,
        "seed": sim.seed,
        "termination_reason": sim.termination_reason,
        "agent_cost": sim.agent_cost,
        "user_cost": sim.user_cost,
        "duration_s": sim.duration,
        **file_facts,
    }
    return Trajectory(
        trajectory_id=sim.id,
        task_id=sim.task_id,
        agent_id=agent_id,
        query=episode.query,
        steps=episode.steps,
        final_answer=episode.final_answer,
        outcome=Outcome(success=sim.reward_info.reward >= 1.0, score=sim.reward_info.reward),
        timestamp=sim.start_time or sim.timestamp,
        metadata={k: v for k, v in metadata.items() if v is not None},
    )


def stream_tau2(
    path: str | Path, *, max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES
) -> RecordStream:
    """Stream the records of a tau2 Results file; each simulation is one record. A document that does not decode whole is read element by element
    (``common.split_document``): a bad element (nested too deeply, over ``max_record_bytes``,
    not JSON) is one quarantined record.

    Raises:
        UnreadableLogError: the file cannot be read, is not JSON, or has no ``simulations`` list.
    """
    path = Path(path)
    document = load_document(path, max_record_bytes)
    if document is None:
        return empty_stream(path, FORMAT)
    doc = document.value
    has_simulations = isinstance(doc, dict) and isinstance(doc.get("simulations"), list)
    require_document_shape(
        path, document, has_simulations, 'a tau2 Results object with a "simulations" list'
    )
    info = doc.get("info")
    agent_id = agent_id_of(info, display_path(path.stem))
    # The agent's system prompt is built from the domain policy; tau2 files hold no system
    # message, so the policy is what identifies the prompt.
    file_facts: dict[str, Any] = {
        "domain": _get(info, "environment_info", "domain_name"),
        "user_llm": _get(info, "user_info", "llm"),
    }
    policy = _get(info, "environment_info", "policy")
    file_facts.update(prompt_fingerprint(policy if isinstance(policy, str) else None, "policy"))

    def convert(obj: dict[str, Any], pointer: str) -> Trajectory:
        return simulation_trajectory(Simulation.model_validate(obj), agent_id, file_facts)

    elements = ((f"/simulations/{i}", sim) for i, sim in enumerate(doc["simulations"]))
    return stream_elements(path, FORMAT, document, elements, convert)
