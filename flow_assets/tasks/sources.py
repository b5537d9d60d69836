"""Task sources: reasoning-gym generators and JSONL files, a fixed held-out split, prompts, verifiers.

Every task has a stable ``task_id``; the held-out split is a fixed function of it::

    held_out(task_id) = int(sha256(task_id).hexdigest(), 16) % 100 < held_out_percent   (20 by default)

so a task never changes side between runs, seeds or dataset sizes.

Prompt template (the policy's input text). The tiny character-level policy only sees a short
prompt, so the template picks the part of the query that matters: for reasoning-gym it is a
``str.format`` template over the entry's ``metadata`` fields plus ``question``; the default for
``spell_backward`` is ``"{word}="``, e.g. the query "Spell this word backward (example: sun -> nus):
neon" becomes the prompt ``"neon="`` and the demonstration completion is ``"noen"`` (the reference
answer; the SFT module appends ``<eos>``). For JSONL tasks the template formats ``{query}``
(default ``"{query}="``). A real base model would use the full question instead
(``prompt_template="{question}"``).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Sequence
from typing import Any, Callable, Literal, Protocol

Split = Literal["train", "held_out"]


def is_held_out(task_id: str, held_out_percent: int = 20) -> bool:
    """True when ``task_id`` belongs to the held-out split (``sha256`` of the id, mod 100, < percent)."""
    return int(hashlib.sha256(task_id.encode("utf-8")).hexdigest(), 16) % 100 < held_out_percent


@dataclass(frozen=True)
class Task:
    """One task with a verifiable answer.

    Attributes:
        task_id: stable id (the GRPO group key and the split key).
        query: the task as its source states it.
        reference: the reference answer.
        prompt: the policy's input text (query through the source's prompt template).
        demonstration: the completion text to imitate in SFT (the reference answer).
        split: ``"train"`` or ``"held_out"``.
        source: where it came from, e.g. ``"reasoning_gym:spell_backward"`` or ``"jsonl:<path>"``.
        verifier: name of the scoring function, e.g. ``"reasoning_gym:spell_backward"`` or ``"exact"``.
        metadata: source-specific extras (for reasoning-gym: the entry's metadata).
    """

    task_id: str
    query: str
    reference: str
    prompt: str
    demonstration: str
    split: Split
    source: str
    verifier: str
    metadata: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)


class TaskSource(Protocol):
    """What the pipeline needs from a task source.

    ``tools`` are the OpenAI function specifications an agent of this source offers its policy
    (empty for single-turn sources).
    """

    tools: tuple[dict[str, Any], ...]

    def tasks(self, split: Split | None = None) -> list[Task]:
        """The tasks, all or of one split, in a fixed order."""
        ...

    def score(self, task: Task, answer: str | None) -> float:
        """The verifier's reward in ``[0, 1]`` for ``answer`` to ``task`` (1.0 = correct)."""
        ...

    def demonstration(self, task: Task) -> list[dict[str, Any]]:
        """An expert's conversation on ``task`` (OpenAI messages), the SFT warm start's data."""
        ...


def task_tools(source: TaskSource, task: Any) -> Sequence[dict[str, Any]]:
    """The OpenAI tool specifications an agent offers its policy on ``task``: the task's own
    (``task.metadata["tools"]``, e.g. a BFCL question's functions) where it carries them, else the
    source's :attr:`TaskSource.tools`. A task that is not a :class:`Task` (a source of plain
    ids) has none of its own."""
    own = (getattr(task, "metadata", None) or {}).get("tools")
    return own or source.tools


def single_turn_demonstration(task: Task) -> list[dict[str, Any]]:
    """The one-turn conversation ``user: prompt, assistant: demonstration``."""
    return [{"role": "user", "content": task.prompt}, {"role": "assistant", "content": task.demonstration}]


# ---------------------------------------------------------------------------------------------
# (a) reasoning-gym


@dataclass(frozen=True)
class ReasoningGymSourceConfig:
    """A reasoning-gym procedural dataset as a task source.

    Attributes:
        name: reasoning-gym dataset name.
        size: number of entries generated (tasks with the same question are merged, so the task
            count can be a little lower).
        seed: generator seed.
        dataset_config: extra keyword arguments for ``reasoning_gym.create_dataset``; the default
            gives 3-5 letter words for ``spell_backward``.
        prompt_template: ``str.format`` template over the entry's ``metadata`` and ``question``.
        held_out_percent: share of task ids (by hash) in the held-out split.
    """

    name: str = "spell_backward"
    size: int = 2000
    seed: int = 0
    dataset_config: dict[str, Any] = field(
        default_factory=lambda: {"min_word_len": 3, "max_word_len": 5}
    )
    prompt_template: str = "{word}="
    held_out_percent: int = 20


class ReasoningGymSource:
    """Tasks generated by ``reasoning_gym.create_dataset``, scored by the dataset's ``score_answer``.

    ``task_id = f"{name}-{sha256(question)[:16]}"``: it depends on the question only, so the same
    question always gets the same id and split (reasoning-gym can draw the same word at two indices;
    those become one task, and a word is never both in train and held-out).
    """

    def __init__(self, config: ReasoningGymSourceConfig | None = None):
        # imported here, not at the top: it pulls in matplotlib (via cellpylib), and every process
        # that loads the code location imports this module whether or not it uses reasoning-gym
        import reasoning_gym

        self.config = config or ReasoningGymSourceConfig()
        c = self.config
        self.dataset = reasoning_gym.create_dataset(c.name, size=c.size, seed=c.seed, **c.dataset_config)
        self._entries: dict[str, dict[str, Any]] = {}
        self._tasks: list[Task] = []
        for entry in self.dataset:
            digest = hashlib.sha256(entry["question"].encode("utf-8")).hexdigest()[:16]
            task_id = f"{c.name}-{digest}"
            if task_id in self._entries:
                continue
            self._entries[task_id] = entry
            answer = str(entry["answer"])
            self._tasks.append(
                Task(
                    task_id=task_id,
                    query=entry["question"],
                    reference=answer,
                    prompt=c.prompt_template.format(question=entry["question"], **entry["metadata"]),
                    demonstration=answer,
                    split="held_out" if is_held_out(task_id, c.held_out_percent) else "train",
                    source=f"reasoning_gym:{c.name}",
                    verifier=f"reasoning_gym:{c.name}",
                    metadata=dict(entry["metadata"]),
                )
            )

    tools: tuple[dict[str, Any], ...] = ()

    def tasks(self, split: Split | None = None) -> list[Task]:
        """All tasks, or those of ``split``, in generation order."""
        return [t for t in self._tasks if split is None or t.split == split]

    def demonstration(self, task: Task) -> list[dict[str, Any]]:
        """:func:`single_turn_demonstration` (the reference answer)."""
        return single_turn_demonstration(task)

    def score(self, task: Task, answer: str | None) -> float:
        """``dataset.score_answer(answer, entry)`` (for spell_backward: 1.0 exact, else partial credit
        per matching leading position, capped below 1).

        Raises:
            KeyError: if ``task`` is not from this source.
        """
        return float(self.dataset.score_answer(answer, self._entries[task.task_id]))


# ---------------------------------------------------------------------------------------------
# (b) JSONL files


def _normalise(text: str) -> str:
    return " ".join(text.split()).casefold()


#: named verifiers for JSONL tasks: ``(answer, reference) -> reward``
VERIFIERS: dict[str, Callable[[str, str], float]] = {
    # exact: equal after stripping surrounding whitespace
    "exact": lambda answer, reference: float(answer.strip() == reference.strip()),
    # exact_ci: equal after collapsing whitespace and case-folding
    "exact_ci": lambda answer, reference: float(_normalise(answer) == _normalise(reference)),
    # contains: the normalised reference occurs in the normalised answer
    "contains": lambda answer, reference: float(_normalise(reference) in _normalise(answer)),
}


@dataclass(frozen=True)
class JsonlSourceConfig:
    """A JSONL file of ``{"task_id": str, "query": str, "reference": str}`` records, one per line.

    Attributes:
        path: the file.
        verifier: one of :data:`VERIFIERS` (``"exact"``, ``"exact_ci"``, ``"contains"``).
        prompt_template: ``str.format`` template over ``{query}``.
        held_out_percent: share of task ids (by hash) in the held-out split.
    """

    path: str = "tasks.jsonl"
    verifier: str = "exact"
    prompt_template: str = "{query}="
    held_out_percent: int = 20


class JsonlSource:
    """Tasks read from a JSONL file, scored by a named verifier.

    Raises (on construction):
        ValueError: unknown verifier; a line that is not a JSON object with string ``task_id``,
            ``query`` and ``reference`` (the message names file and line); a duplicate ``task_id``.
        OSError: the file cannot be read.
    """

    def __init__(self, config: JsonlSourceConfig):
        if config.verifier not in VERIFIERS:
            raise ValueError(f"unknown verifier {config.verifier!r}; known: {sorted(VERIFIERS)}")
        self.config = config
        self._tasks: list[Task] = []
        seen: set[str] = set()
        with open(config.path, encoding="utf-8") as f:
            for line_no, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                    fields = {k: record[k] for k in ("task_id", "query", "reference")}
                except (json.JSONDecodeError, KeyError, TypeError) as e:
                    raise ValueError(f"{config.path}:{line_no}: not a task record ({e})") from e
                if not all(isinstance(v, str) for v in fields.values()):
                    raise ValueError(f"{config.path}:{line_no}: task_id, query, reference must be strings")
                if fields["task_id"] in seen:
                    raise ValueError(f"{config.path}:{line_no}: duplicate task_id {fields['task_id']!r}")
                seen.add(fields["task_id"])
                self._tasks.append(
                    Task(
                        task_id=fields["task_id"],
                        query=fields["query"],
                        reference=fields["reference"],
                        prompt=config.prompt_template.format(query=fields["query"]),
                        demonstration=fields["reference"],
                        split="held_out" if is_held_out(fields["task_id"], config.held_out_percent) else "train",
                        source=f"jsonl:{Path(config.path).name}",
                        verifier=config.verifier,
                    )
                )

    tools: tuple[dict[str, Any], ...] = ()

    def tasks(self, split: Split | None = None) -> list[Task]:
        """All tasks, or those of ``split``, in file order."""
        return [t for t in self._tasks if split is None or t.split == split]

    def demonstration(self, task: Task) -> list[dict[str, Any]]:
        """:func:`single_turn_demonstration` (the reference answer)."""
        return single_turn_demonstration(task)

    def score(self, task: Task, answer: str | None) -> float:
        """The named verifier's reward (0.0 for a missing answer)."""
        if answer is None:
            return 0.0
        return VERIFIERS[self.config.verifier](answer, task.reference)
