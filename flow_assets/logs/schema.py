"""The canonical trajectory record: what every log format is parsed into.

One :class:`Trajectory` is one episode of one agent on one task (see ``docs/log-format.md``,
whose JSON Schema ``trajectory.schema.json`` is generated from these models). Validation is
strict on types (a string where a number belongs is an error, not a coercion) because a silently
coerced reward is worse than a quarantined record.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# Checked inside pydantic-core (no Python callback per number: a batch holds millions): in
# strict mode a float field takes a JSON int (as 1.0) but refuses bools and numeric strings, and
# allow_inf_nan=False refuses NaN and infinity.
FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
"""A finite float field (ints accepted, bools, strings and NaN/infinity refused), for strict models."""

OptionalFiniteFloat = Annotated[float | None, Field(allow_inf_nan=False)]
"""Like :data:`FiniteFloat` but ``null`` allowed."""

StepKind = Literal["plan", "tool", "verify", "answer", "message", "observation"]
STEP_KINDS: tuple[str, ...] = ("plan", "tool", "verify", "answer", "message", "observation")
#: kinds that are the agent's own decisions; an ``observation`` (a tool result the environment
#: returned, logged as its own step) is context, not a decision
DECISION_KINDS: tuple[str, ...] = ("plan", "tool", "verify", "answer", "message")


class Step(BaseModel):
    """One agent decision inside a trajectory (an LLM turn) and its result, or an ``observation``
    (a tool result the agent received, logged as its own step).

    Token fields are present only for turns of a trainable policy captured by the gateway:
    ``prompt_token_ids`` are the exact ids the policy was given for this turn (the chat template
    rendered by the gateway), ``token_ids`` the sampled completion ids and ``logprobs`` the
    behaviour policy's log-probability of each (natural log, same length, computed at
    ``temperature``). Together they make the GRPO importance ratio exact: training consumes these
    ids as they are and never re-tokenises text.

    Raises:
        pydantic.ValidationError: on a wrong type, an unknown ``kind``, a non-finite number,
            ``token_ids``/``logprobs`` of different lengths, ``prompt_token_ids`` without
            ``token_ids``, ``temperature < 0`` or ``top_p`` outside (0, 1].
    """

    model_config = ConfigDict(extra="forbid", strict=True)

    index: int = Field(ge=0, description="0-based position of the step in its trajectory")
    kind: StepKind
    module: str | None = Field(None, description="agent component that took the step")
    tool: str | None = Field(None, description="tool name, for kind == 'tool'")
    input: Any = Field(None, description="tool arguments or prompt (any JSON)")
    output: Any = Field(None, description="tool result or generated text (any JSON)")
    status: Literal["ok", "error"] = "ok"
    confidence: OptionalFiniteFloat = Field(None, ge=0.0, le=1.0)
    duration_ms: OptionalFiniteFloat = Field(None, ge=0.0, description="wall time of the step, ms")
    token_ids: list[int] | None = None
    logprobs: list[FiniteFloat] | None = None
    prompt_token_ids: list[int] | None = Field(
        None, description="the exact prompt token ids of this turn (chat template rendered by the gateway)"
    )
    temperature: OptionalFiniteFloat = Field(
        None, ge=0.0, description="sampling temperature of this turn; logprobs are log_softmax(logits / T) (T = 1 when 0)"
    )
    top_p: OptionalFiniteFloat = Field(None, gt=0.0, le=1.0, description="nucleus sampling threshold of this turn")

    @model_validator(mode="after")
    def _tokens_match_logprobs(self) -> Step:
        if self.logprobs is not None:
            if self.token_ids is None or len(self.token_ids) != len(self.logprobs):
                raise ValueError("token_ids and logprobs must have the same length")
        if self.prompt_token_ids is not None and self.token_ids is None:
            raise ValueError("prompt_token_ids need the turn's token_ids")
        return self


class Outcome(BaseModel):
    """How the episode ended: ``success`` (verifier / task check) and ``score`` (a scalar reward,
    usually in [0, 1]). At least one of them must be given; both must be finite."""

    model_config = ConfigDict(extra="forbid", strict=True)

    success: bool | None = None
    score: OptionalFiniteFloat = None

    @model_validator(mode="after")
    def _something_known(self) -> Outcome:
        if self.success is None and self.score is None:
            raise ValueError("outcome needs success or score")
        return self


class Trajectory(BaseModel):
    """One episode: query, ordered steps, final answer, outcome (flowopt canonical format v1).

    Raises:
        pydantic.ValidationError: on a missing ``task_id``/``trajectory_id``, a wrong type, steps
            whose ``index`` is not 0..n-1 in order, or an invalid step/outcome.
    """

    model_config = ConfigDict(extra="forbid", strict=True)

    trajectory_id: str = Field(min_length=1)
    task_id: str = Field(min_length=1)
    agent_id: str = Field(min_length=1)
    adapter_version: str | None = None
    query: str
    steps: list[Step]
    final_answer: str | None = None
    outcome: Outcome | None = Field(
        None, description="how the episode ended; absent (or null) for an unlabelled trajectory: stored, no reward yet"
    )
    timestamp: str | None = Field(None, description="ISO 8601 start time of the episode")
    metadata: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _ordered_steps(self) -> Trajectory:
        for position, step in enumerate(self.steps):
            if step.index != position:
                raise ValueError(f"steps[{position}].index is {step.index}, expected {position}")
        return self


def json_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of one canonical JSONL line."""
    schema = Trajectory.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["$id"] = "https://flowopt.dev/schemas/trajectory.v1.json"
    return schema
