"""BFCL's own entry point (``bfcl generate``, then ``bfcl evaluate``) pointed at an OpenAI-compatible
endpoint such as the gateway, and its verdicts read back, so that flowopt's scoring of a policy
(:class:`~flow_assets.tasks.bfcl.BfclSource`) can be compared id by id with BFCL's own.

BFCL runs unmodified, with every dependency it declares, in a virtual environment of its own
(``make install-bfcl-cli``: ``.venv-bfcl``), as a subprocess: its CLI imports every vendor SDK of
its model registry, whose pins (numpy 1.26.4 and more) flowopt's environment does not take.

How it is pointed at the gateway (bfcl-eval 2026.3.23, read in its code):

- the model is :data:`ENTRY_MODEL`, the one entry of BFCL's registry
  (``constants/model_config.py``) whose handler is its plain OpenAI Chat Completions FC handler
  (``OpenAICompletionsHandler``, with ``underscore_to_dot=True``): the same handler whose tool
  compilation and response parsing :mod:`flow_assets.tasks.bfcl` calls. It sends
  ``model=ENTRY_MODEL``, so the gateway serves the policy under that name too;
- the handler builds ``OpenAI(base_url=$OPENAI_BASE_URL, api_key=$OPENAI_API_KEY)``;
  ``$BFCL_PROJECT_ROOT`` holds ``test_case_ids_to_generate.json`` (read by ``--run-ids``),
  ``result/`` and ``score/``. These variables are set in the subprocess's environment only
  (:func:`cli_environment`); flowopt's own environment is never changed;
- it sends no ``max_tokens`` (the gateway's default cap applies) and the temperature of
  ``--temperature`` (BFCL's default is 0.001; flowopt's greedy mode is 0).

What BFCL writes, and :func:`read_verdicts` reads: ``result/<model>/non_live/BFCL_v4_<category>_result.json``
(one JSON object per line with the ``id`` of every generated entry) and
``score/<model>/non_live/BFCL_v4_<category>_score.json`` (a header line with ``accuracy``,
``correct_count`` and ``total_count``, then one line per entry it judged wrong, with its ``id``).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from flow_assets.tasks.sources import Task

#: BFCL's registered model whose handler is its plain OpenAI Chat Completions FC handler
ENTRY_MODEL = "openbmb/MiniCPM-SALA-FC"
#: the file ``bfcl generate --run-ids`` reads, under ``$BFCL_PROJECT_ROOT``
IDS_FILE = "test_case_ids_to_generate.json"


def run_ids_file(tasks: Iterable[Task]) -> dict[str, list[str]]:
    """``{category: [BFCL id, ...]}`` of ``tasks`` (tasks of :class:`~flow_assets.tasks.bfcl.BfclSource`),
    in the order given: the content of :data:`IDS_FILE`.

    Raises:
        ValueError: a task without ``metadata["bfcl_id"]`` / ``["category"]`` (not a BFCL task).
    """
    ids: dict[str, list[str]] = defaultdict(list)
    for task in tasks:
        meta = task.metadata or {}
        if "bfcl_id" not in meta or "category" not in meta:
            raise ValueError(f"task {task.task_id!r} is not a BFCL task (metadata has no bfcl_id / category)")
        ids[meta["category"]].append(meta["bfcl_id"])
    return dict(ids)


def cli_commands(python: str | Path, categories: Sequence[str], temperature: float, threads: int) -> list[list[str]]:
    """The two commands, as argument lists: ``bfcl generate`` of :data:`ENTRY_MODEL` on the ids of
    :data:`IDS_FILE` only (``--run-ids``) at ``temperature`` with ``threads`` requests at once, then
    ``bfcl evaluate --partial-eval`` (BFCL scores the generated entries, not the whole category)."""
    cats = ",".join(categories)
    cli = [str(python), "-m", "bfcl_eval"]
    return [
        [*cli, "generate", "--model", ENTRY_MODEL, "--test-category", cats, "--run-ids", "--temperature", str(temperature),
         "--num-threads", str(threads), "--allow-overwrite"],
        [*cli, "evaluate", "--model", ENTRY_MODEL, "--test-category", cats, "--partial-eval"],
    ]  # fmt: skip


def cli_environment(base_url: str, project_root: str | Path) -> dict[str, str]:
    """What the subprocess's environment adds to flowopt's (laid over a copy of it by
    :func:`~flow_assets.settings.child_environ`; flowopt's own stays as it is):
    ``OPENAI_BASE_URL`` (``base_url``, e.g. ``http://127.0.0.1:PORT/v1``), a placeholder
    ``OPENAI_API_KEY`` (the gateway needs none; the OpenAI client refuses to start without one) and
    ``BFCL_PROJECT_ROOT``."""
    return {"OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": "unused-by-the-gateway", "BFCL_PROJECT_ROOT": str(project_root)}


def _json_lines(path: Path) -> list[tuple[int, dict]]:
    """The JSON objects of ``path``, one per non-blank line, each with its line number (from 1)."""
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{number}: not JSON ({exc.msg})") from exc
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{number}: a JSON object was expected, got {type(row).__name__}")
        rows.append((number, row))
    return rows


def _one_file(root: Path, kind: str, category: str) -> Path:
    name = f"BFCL_v4_{category}_{kind}.json"
    found = sorted(root.glob(f"{kind}/*/non_live/{name}"))
    if len(found) != 1:
        raise FileNotFoundError(f"expected one {name} under {root / kind}, found {len(found)}")
    return found[0]


def read_verdicts(project_root: str | Path, categories: Sequence[str]) -> tuple[dict[str, bool], dict[str, dict]]:
    """BFCL's verdicts on every entry it generated, from its result and score files (module docstring).

    Returns:
        ``{BFCL id: valid}`` for every generated id, and ``{category: header}`` (BFCL's
        ``accuracy``, ``correct_count``, ``total_count``).

    Raises:
        FileNotFoundError: a category's result or score file is missing (the run did not finish).
        ValueError: a line is not a JSON object, a row has no ``id`` (file and line named), or the
            score file's counts disagree with the ids it lists.
    """
    root = Path(project_root)
    verdicts: dict[str, bool] = {}
    headers: dict[str, dict] = {}
    for category in categories:
        result_path, score_path = _one_file(root, "result", category), _one_file(root, "score", category)
        numbered_results, numbered_scores = _json_lines(result_path), _json_lines(score_path)
        for path, rows in ((result_path, numbered_results), (score_path, numbered_scores[1:])):
            for number, row in rows:
                if "id" not in row:
                    raise ValueError(f"{path}:{number}: a row without 'id'")
        if not numbered_scores or "accuracy" not in numbered_scores[0][1]:
            raise ValueError(f"{score_path}:{numbered_scores[0][0] if numbered_scores else 1}: no header with 'accuracy'")
        header_line, header = numbered_scores[0]
        wrong = {row["id"] for _, row in numbered_scores[1:]}
        generated = [row["id"] for _, row in numbered_results]
        if header.get("total_count") != len(generated) or header.get("correct_count") != len(generated) - len(wrong & set(generated)):
            raise ValueError(f"{score_path}:{header_line}: counts {header.get('correct_count')} / {header.get('total_count')} disagree with "
                             f"{len(generated)} generated ids and {len(wrong)} listed as wrong")  # fmt: skip
        headers[category] = {k: header[k] for k in ("accuracy", "correct_count", "total_count")}
        verdicts.update({i: i not in wrong for i in generated})
    return verdicts, headers


def compare_verdicts(ours: Mapping[str, bool], theirs: Mapping[str, bool], category_of: Mapping[str, str]) -> dict[str, dict]:
    """flowopt's verdicts against BFCL's on the ids both judged, per category and ``overall``.

    Args:
        ours / theirs: ``{BFCL id: valid}``.
        category_of: ``{BFCL id: category}``.

    Returns:
        ``{category: {"n", "flowopt", "bfcl" (accuracies), "agree" (ids with the same verdict),
        "only_flowopt" / "only_bfcl" (ids only one side judged valid)}}``.

    Raises:
        ValueError: the two sides judged different ids (a run lost entries).
    """
    if set(ours) != set(theirs):
        missing, extra = sorted(set(ours) - set(theirs)), sorted(set(theirs) - set(ours))
        raise ValueError(f"the two sides judged different ids: {len(missing)} only by flowopt {missing[:5]}, "
                         f"{len(extra)} only by BFCL {extra[:5]}")  # fmt: skip
    groups: dict[str, list[str]] = defaultdict(list)
    for i in sorted(ours):
        groups[category_of[i]].append(i)
        groups["overall"].append(i)
    out = {}
    for name, ids in groups.items():
        n = len(ids)
        out[name] = {
            "n": n, "flowopt": sum(ours[i] for i in ids) / n, "bfcl": sum(theirs[i] for i in ids) / n,
            "agree": sum(ours[i] == theirs[i] for i in ids),
            "only_flowopt": [i for i in ids if ours[i] and not theirs[i]], "only_bfcl": [i for i in ids if theirs[i] and not ours[i]],
        }  # fmt: skip
    return out
