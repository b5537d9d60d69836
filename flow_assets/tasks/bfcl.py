"""BFCL v4 (the Berkeley Function Calling Leaderboard) as a task source, scored by BFCL's own checker.

Tasks are the questions of BFCL v4's non-live AST categories (:data:`CATEGORIES`: ``simple_python``
400, ``multiple`` 200, ``parallel`` 200, ``parallel_multiple`` 200, ``irrelevance`` 240), read from
the question files the ``bfcl-eval`` wheel ships (``bfcl_eval/data/BFCL_v4_<category>.json``, one
JSON entry per line, possible answers in ``data/possible_answer/``). Every task has its own tool set
(the entry's function documents), so it travels with the task, not the source::

    task.metadata["messages"]   the first turn's OpenAI messages (BFCL: entry["question"][0])
    task.metadata["tools"]      the OpenAI tool specs the agent sends as ``tools=`` (source.tools is empty)

An agent answers with the assistant message it got back, as JSON text (``message.model_dump_json()``);
:meth:`BfclSource.score` gives 1.0 exactly when BFCL's evaluation marks it valid, 0.0 otherwise.

Everything BFCL-specific is BFCL's code, called, not copied (``bfcl-eval==2026.3.23``):

- questions and possible answers: ``bfcl_eval.utils.load_dataset_entry`` and ``load_ground_truth_entry``,
  as BFCL's generation (with the language hint in the function descriptions) and its evaluation
  (``eval_checker/eval_runner.py:evaluate_task``: without the hint) load them;
- tool specs: ``OpenAICompletionsHandler._compile_tools`` (``model_handler/api_inference/openai_completion.py``),
  which calls ``model_handler/utils.py:convert_to_tool(functions, GORILLA_TO_OPENAPI,
  ModelStyle.OPENAI_COMPLETIONS)``: parameter type ``dict`` becomes ``object``, ``float`` ``number``
  (with ``format: float``), ``tuple`` ``array``, an unknown type ``string``, and dots in function names
  become underscores (OpenAI allows ``^[a-zA-Z0-9_-]{1,64}$``);
- the answer as BFCL records it: ``OpenAICompletionsHandler._parse_query_response_FC`` (a list of
  ``{name: arguments JSON}``, or the message's text when it has no tool calls);
- the verdict: ``eval_checker/eval_runner.py:_evaluate_single_ast_entry`` (the handler's ``decode_ast``,
  ``utils.is_function_calling_format_output``, then ``ast_eval/ast_checker.py:ast_checker`` with
  ``Language.PYTHON``) and, for ``irrelevance``, ``_evaluate_single_relevance_entry`` (valid exactly
  when the answer decodes to no function call). Names are not mapped back: the checker compares the
  called names with the documents' names with dots replaced by underscores
  (``ast_checker.convert_func_name``), because BFCL's config for its OpenAI Chat Completions FC handler
  sets ``underscore_to_dot=True``.

Split: ``task_id = "bfcl-v4-<BFCL id>"`` (e.g. ``bfcl-v4-simple_python_0``), held out when
:func:`~flow_assets.tasks.sources.is_held_out` says so (sha256 of the id, mod 100, below
``held_out_percent``, 30 by default): a task never changes side. With 30 (train / held-out):
``simple_python`` 272 / 128, ``multiple`` 141 / 59, ``parallel`` 152 / 48, ``parallel_multiple``
148 / 52, ``irrelevance`` 160 / 80; 873 / 367 in all.

Installing (``make install-bfcl``): ``pip install --no-deps bfcl-eval==2026.3.23`` plus the few
packages the modules above import (:data:`BFCL_RUNTIME`). bfcl-eval's declared dependencies pin
numpy 1.26.4, networkx 3.3, filelock 3.20.0 and pull in every vendor SDK of its model handlers; none
is imported on this path but one: ``ast_checker.py`` and ``eval_runner.py`` import
``MODEL_CONFIG_MAPPING`` from ``bfcl_eval/constants/model_config.py``, which imports every model
handler (mistralai, cohere, google-genai, boto3, qwen-agent, ...) to build BFCL's model registry.
The checker reads one field of it, ``MODEL_CONFIG_MAPPING[model].underscore_to_dot``
(``convert_func_name``). So :func:`bfcl_api` imports those modules with a stand-in
``bfcl_eval.constants.model_config`` in ``sys.modules`` that holds one entry, :data:`MODEL_NAME`,
with ``underscore_to_dot=True`` (the value BFCL gives its Chat Completions FC handler's model,
``openbmb/MiniCPM-SALA-FC``; a test reads it from ``model_config.py``), then removes the stand-in
and un-registers the modules that bound it (this module keeps its references), so a full BFCL
install imported later in the same process gets its real registry. The ``bfcl_eval`` package
``__init__`` files are empty: nothing else heavy is imported. ``bfcl_eval/constants/eval_config.py``
creates ``result/``, ``score/`` and ``.file_locks/`` under ``$BFCL_PROJECT_ROOT`` (default: the
site-packages directory) when imported, and BFCL's loaders keep their lock files there; set the
variable before flowopt starts to put them elsewhere (flowopt never sets it: the environment is
read by every thread, so it is not changed at run time).
"""

from __future__ import annotations

import json
import sys
import threading
import types
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Iterator

from flow_assets.tasks.sources import Split, Task, is_held_out

#: the bfcl-eval release this module is written against (``make install-bfcl`` installs it)
BFCL_VERSION = "2026.3.23"
#: what bfcl-eval's modules on the checker path import besides the standard library and flowopt's own
#: dependencies (filelock, openai, and numpy, pandas, python-dotenv, tqdm, which eval_runner imports
#: for its reports): the ``bfcl`` extra of pyproject.toml, installed beside ``bfcl-eval --no-deps``
BFCL_RUNTIME = ("tree_sitter==0.21.3", "tree-sitter-java==0.21.0", "tree-sitter-javascript==0.21.4", "overrides>=7.3", "tenacity>=8.5")
#: the non-live AST categories (single turn, Python)
CATEGORIES = ("simple_python", "multiple", "parallel", "parallel_multiple", "irrelevance")
#: the model name BFCL's checker is called with (its key in the stand-in model registry)
MODEL_NAME = "flowopt-FC"
#: the text of a demonstration on an ``irrelevance`` task (no function call is the right answer)
NO_CALL_ANSWER = "None of the available functions can answer this request."

_MODEL_CONFIG = "bfcl_eval.constants.model_config"


class BfclUnavailable(ImportError):
    """``bfcl_eval`` (or one of :data:`BFCL_RUNTIME`) is not installed; the message says how to install it."""


@dataclass(frozen=True)
class _CheckerModelConfig:
    """The one field of BFCL's ``ModelConfig`` the AST checker reads (and ``is_fc_model``, for the record)."""

    underscore_to_dot: bool = True
    is_fc_model: bool = True


@dataclass(frozen=True)
class BfclApi:
    """The BFCL functions this module calls, imported once by :func:`bfcl_api`.

    Attributes:
        load_dataset_entry: ``bfcl_eval.utils.load_dataset_entry(category, include_prereq=True,
            include_language_specific_hint=True) -> list[dict]`` (entries ``{id, question, function}``).
        load_ground_truth_entry: ``bfcl_eval.utils.load_ground_truth_entry(category) -> list[dict]``
            (entries ``{id, ground_truth}``).
        ast_checker: ``bfcl_eval.eval_checker.ast_eval.ast_checker.ast_checker(func_description,
            model_output, possible_answer, language, test_category, model_name) -> {"valid", ...}``.
        evaluate_ast_entry: ``bfcl_eval.eval_checker.eval_runner._evaluate_single_ast_entry``.
        evaluate_relevance_entry: ``bfcl_eval.eval_checker.eval_runner._evaluate_single_relevance_entry``.
        handler: an ``OpenAICompletionsHandler`` in FC mode named :data:`MODEL_NAME`, built without
            its OpenAI client (its ``__init__`` opens one and needs an API key; the methods called here
            never use it).
        Language / ReturnFormat: ``bfcl_eval.constants.enums`` (``Language.PYTHON``, ``ReturnFormat.PYTHON``).
        chat_completion: ``openai.types.chat.ChatCompletion`` (what the handler parses).
        prompt_path: ``bfcl_eval.constants.eval_config.PROMPT_PATH`` (the question files).
        possible_answer_path: ``bfcl_eval.constants.eval_config.POSSIBLE_ANSWER_PATH``.
        version_prefix: ``bfcl_eval.constants.category_mapping.VERSION_PREFIX`` (``"BFCL_v4"``).
    """

    load_dataset_entry: Callable[..., list[dict]]
    load_ground_truth_entry: Callable[[str], list[dict]]
    ast_checker: Callable[..., dict]
    evaluate_ast_entry: Callable[..., dict]
    evaluate_relevance_entry: Callable[..., dict]
    handler: Any
    Language: Any
    ReturnFormat: Any
    chat_completion: Any
    prompt_path: Path
    possible_answer_path: Path
    version_prefix: str

    def question_file(self, category: str) -> Path:
        """The question file of ``category`` (``.../data/BFCL_v4_<category>.json``)."""
        return self.prompt_path / f"{self.version_prefix}_{category}.json"

    def answer_file(self, category: str) -> Path:
        """The possible-answer file of ``category``."""
        return self.possible_answer_path / f"{self.version_prefix}_{category}.json"


_IMPORT_LOCK = threading.Lock()  # one thread swaps the stand-in in and out


@contextmanager
def _checker_import_context() -> Iterator[types.ModuleType]:
    """Import BFCL's checker modules without its model registry (see the module docstring)."""
    stand_in = types.ModuleType(_MODEL_CONFIG, "flowopt's stand-in for BFCL's model registry (flow_assets/tasks/bfcl.py)")
    stand_in.MODEL_CONFIG_MAPPING = {MODEL_NAME.replace("_", "/"): _CheckerModelConfig()}
    added = _MODEL_CONFIG not in sys.modules
    if added:
        sys.modules[_MODEL_CONFIG] = stand_in
    before = set(sys.modules)
    try:
        yield stand_in
    finally:
        if added:
            del sys.modules[_MODEL_CONFIG]
            for name in set(sys.modules) - before:
                if getattr(sys.modules[name], "MODEL_CONFIG_MAPPING", None) is stand_in.MODEL_CONFIG_MAPPING:
                    del sys.modules[name]


@lru_cache(maxsize=1)
def bfcl_api() -> BfclApi:
    """Import the BFCL functions this module calls (once per process, about a second).

    Raises:
        BfclUnavailable: ``bfcl_eval`` or a package it imports is missing (install: ``make install-bfcl``).
        RuntimeError: the installed bfcl-eval is not the one this module is written for, or its
            checker resolves :data:`MODEL_NAME` to a config without ``underscore_to_dot``.
    """
    from importlib.metadata import PackageNotFoundError, version

    try:
        installed = version("bfcl-eval")
    except PackageNotFoundError as exc:
        raise BfclUnavailable(
            f"bfcl-eval is not installed: `make install-bfcl` (pip install --no-deps bfcl-eval=={BFCL_VERSION} "
            f"{' '.join(BFCL_RUNTIME)})"
        ) from exc
    if installed != BFCL_VERSION:
        raise RuntimeError(f"bfcl-eval {installed} is installed; flow_assets.tasks.bfcl is written for {BFCL_VERSION}")
    try:
        with _IMPORT_LOCK, _checker_import_context():
            from bfcl_eval.constants.category_mapping import VERSION_PREFIX
            from bfcl_eval.constants.enums import Language, ModelStyle, ReturnFormat
            from bfcl_eval.constants.eval_config import POSSIBLE_ANSWER_PATH, PROMPT_PATH
            from bfcl_eval.eval_checker.ast_eval import ast_checker as ast_checker_module
            from bfcl_eval.eval_checker.eval_runner import _evaluate_single_ast_entry, _evaluate_single_relevance_entry
            from bfcl_eval.model_handler.api_inference.openai_completion import OpenAICompletionsHandler
            from bfcl_eval.model_handler.base_handler import BaseHandler
            from bfcl_eval.utils import load_dataset_entry, load_ground_truth_entry
        from openai.types.chat import ChatCompletion
    except ImportError as exc:
        raise BfclUnavailable(
            f"bfcl-eval's checker cannot be imported ({exc}); install what it needs: `make install-bfcl`"
        ) from exc
    config = ast_checker_module.MODEL_CONFIG_MAPPING.get(MODEL_NAME.replace("_", "/"))
    if config is None or not config.underscore_to_dot:
        raise RuntimeError(
            f"BFCL's checker resolves {MODEL_NAME!r} to {config!r}; it must compare names with dots as "
            "underscores (underscore_to_dot=True), as BFCL does for its OpenAI FC handler"
        )
    handler = OpenAICompletionsHandler.__new__(OpenAICompletionsHandler)
    BaseHandler.__init__(handler, MODEL_NAME, 0.0, MODEL_NAME, True)
    handler.model_style = ModelStyle.OPENAI_COMPLETIONS
    return BfclApi(
        load_dataset_entry=load_dataset_entry,
        load_ground_truth_entry=load_ground_truth_entry,
        ast_checker=ast_checker_module.ast_checker,
        evaluate_ast_entry=_evaluate_single_ast_entry,
        evaluate_relevance_entry=_evaluate_single_relevance_entry,
        handler=handler,
        Language=Language,
        ReturnFormat=ReturnFormat,
        chat_completion=ChatCompletion,
        prompt_path=Path(PROMPT_PATH),
        possible_answer_path=Path(POSSIBLE_ANSWER_PATH),
        version_prefix=VERSION_PREFIX,
    )


# ---------------------------------------------------------------------------------------------
# the entries


@dataclass(frozen=True)
class BfclEntry:
    """One BFCL question, as generation and evaluation see it.

    Attributes:
        bfcl_id: BFCL's id, e.g. ``"simple_python_0"``.
        category: one of :data:`CATEGORIES`.
        messages: the first turn's OpenAI messages (``entry["question"][0]``).
        tools: the OpenAI tool specs BFCL's Chat Completions FC handler sends (from the function
            documents with the language hint, as generation loads them).
        functions: the function documents as evaluation loads them (no hint): what the checker gets.
        ground_truth: BFCL's possible answer, ``[{function name: {argument: [allowed values]}}]``
            (``""`` among the allowed values: the argument may be omitted); ``[]`` for ``irrelevance``.
        tool_names: the function documents' names mapped to the tool names (dots as underscores).
        line: the entry's line in its question file (1-based).
    """

    bfcl_id: str
    category: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    functions: list[dict[str, Any]]
    ground_truth: list[dict[str, dict[str, list]]]
    tool_names: dict[str, str]
    line: int


def _check_entry(entry: Any, where: str) -> None:
    if not isinstance(entry, dict) or not isinstance(entry.get("id"), str):
        raise ValueError(f"{where}: not a BFCL entry (expected an object with a string 'id')")
    question = entry.get("question")
    if not (isinstance(question, list) and question and isinstance(question[0], list) and question[0]):
        raise ValueError(f"{where}: field 'question' must be a non-empty list of turns, each a list of messages")
    for k, message in enumerate(question[0]):
        if not (isinstance(message, dict) and isinstance(message.get("role"), str) and isinstance(message.get("content"), str)):
            raise ValueError(f"{where}: field 'question[0][{k}]' must be a message with string 'role' and 'content'")
    functions = entry.get("function")
    if not (isinstance(functions, list) and functions):
        raise ValueError(f"{where}: field 'function' must be a non-empty list of function documents")
    for k, doc in enumerate(functions):
        parameters = doc.get("parameters") if isinstance(doc, dict) else None
        if not (isinstance(doc, dict) and isinstance(doc.get("name"), str) and isinstance(parameters, dict)
                and isinstance(parameters.get("properties"), dict)):  # fmt: skip
            raise ValueError(f"{where}: field 'function[{k}]' must have a string 'name' and 'parameters.properties'")


def load_entries(category: str) -> list[BfclEntry]:
    """The entries of one category, in file order, loaded by BFCL's own loaders.

    Questions: ``load_dataset_entry(category)`` (with the language hint; tools compiled from it by
    the handler's ``_compile_tools``) and ``load_dataset_entry(category, include_prereq=False,
    include_language_specific_hint=False)`` (the function documents the checker gets, as
    ``eval_runner.evaluate_task`` loads them). Possible answers: ``load_ground_truth_entry(category)``,
    paired by position as ``eval_runner._subset_entries_by_model_ids`` pairs them.

    Raises:
        ValueError: ``category`` is not one of :data:`CATEGORIES`; an entry lacks a field or has the
            wrong shape, or its possible answer has another id (the message names file, line, field).
        BfclUnavailable: bfcl-eval is not installed.
    """
    if category not in CATEGORIES:
        raise ValueError(f"unknown BFCL category {category!r}; known: {list(CATEGORIES)}")
    api = bfcl_api()
    path = api.question_file(category)
    hinted = api.load_dataset_entry(category)
    plain = api.load_dataset_entry(category, include_prereq=False, include_language_specific_hint=False)
    answers = [] if category == "irrelevance" else api.load_ground_truth_entry(category)
    if len(plain) != len(hinted) or (answers and len(answers) != len(plain)):
        raise ValueError(f"{path}: {len(plain)} questions but {len(answers)} possible answers in {api.answer_file(category)}")
    entries = []
    for index, (generation, evaluation) in enumerate(zip(hinted, plain)):
        where = f"{path}:{index + 1}"  # BFCL's load_file reads one JSON entry per line
        _check_entry(evaluation, where)
        try:
            tools = api.handler._compile_tools({}, generation)["tools"]
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"{where}: field 'function': BFCL's convert_to_tool rejects it ({type(exc).__name__}: {exc})") from exc
        ground_truth: list = []
        if answers:
            answer = answers[index]
            answer_where = f"{api.answer_file(category)}:{index + 1}"
            if not isinstance(answer, dict) or answer.get("id") != evaluation["id"]:
                raise ValueError(f"{answer_where}: field 'id' is {answer.get('id') if isinstance(answer, dict) else answer!r}, "
                                 f"expected {evaluation['id']!r} (possible answers pair with questions by line)")  # fmt: skip
            ground_truth = answer.get("ground_truth")
            if not (isinstance(ground_truth, list) and ground_truth and all(
                isinstance(call, dict) and len(call) == 1 and isinstance(next(iter(call.values())), dict) for call in ground_truth
            )):  # fmt: skip
                raise ValueError(f"{answer_where}: field 'ground_truth' must be a non-empty list of {{function: {{argument: [values]}}}}")
        entries.append(
            BfclEntry(
                bfcl_id=evaluation["id"],
                category=category,
                messages=generation["question"][0],
                tools=tools,
                functions=evaluation["function"],
                ground_truth=ground_truth,
                tool_names={doc["name"]: tool["function"]["name"] for doc, tool in zip(evaluation["function"], tools)},
                line=index + 1,
            )
        )
    return entries


# ---------------------------------------------------------------------------------------------
# answers: what a model emits, and BFCL's verdict on it

_OMIT = object()


def _first_allowed(values: Any, where: str) -> Any:
    """The first allowed value of a possible-answer list, as a model would write it; ``_OMIT`` when
    it is ``""`` (BFCL's mark of an argument that may be left out). Dicts (the allowed values of a
    ``dict`` argument, or of each item of a list of dicts) map keys to allowed-value lists themselves."""
    if not isinstance(values, list) or not values:
        raise ValueError(f"{where}: expected a non-empty list of allowed values, got {values!r}")
    value = values[0]
    if isinstance(value, str) and value == "":
        return _OMIT
    if isinstance(value, dict):
        return _first_allowed_arguments(value, where)
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        return [_first_allowed_arguments(v, where) for v in value]
    return value


def _first_allowed_arguments(allowed: dict[str, Any], where: str) -> dict[str, Any]:
    rendered = {}
    for name, values in allowed.items():
        value = _first_allowed(values, f"{where}.{name}")
        if value is not _OMIT:
            rendered[name] = value
    return rendered


def possible_answer_tool_calls(entry: BfclEntry) -> list[dict[str, Any]]:
    """BFCL's possible answer to ``entry`` as the OpenAI ``tool_calls`` a model would emit: one call
    per function of :attr:`BfclEntry.ground_truth`, named as its tool (dots as underscores), each
    argument the first of its allowed values, as JSON text. An argument whose first allowed value is
    ``""`` (may be omitted) is left out, with two exceptions that make the answer what the function
    documents ask for: a required parameter takes its first other value, and an argument the
    document does not declare is left out whenever ``""`` is allowed (BFCL's data has one of each:
    ``simple_python_200``, ``parallel_multiple_26``). Nested dicts take their first allowed values.

    Returns:
        ``[{"id": "call_<i>", "type": "function", "function": {"name", "arguments"}}]``.

    Raises:
        ValueError: an allowed-value list is empty or not a list (the message names the argument).
        KeyError: a function the possible answer calls has no document in ``entry``.
    """
    docs = {doc["name"]: doc["parameters"] for doc in entry.functions}
    calls = []
    for i, call in enumerate(entry.ground_truth):
        ((name, allowed),) = call.items()
        required, declared = set(docs[name].get("required", ())), docs[name]["properties"]
        arguments = {}
        for argument, values in allowed.items():
            where = f"{entry.bfcl_id}: {name}.{argument}"
            if argument not in declared and isinstance(values, list) and "" in values:
                continue
            if argument in required and isinstance(values, list):
                values = [v for v in values if not (isinstance(v, str) and v == "")] or values
            value = _first_allowed(values, where)
            if value is not _OMIT:
                arguments[argument] = value
        calls.append({"id": f"call_{i}", "type": "function", "function": {"name": entry.tool_names[name], "arguments": json.dumps(arguments)}})
    return calls


def assistant_message(tool_calls: list[dict[str, Any]] | None = None, content: str | None = None) -> str:
    """An assistant message as an agent hands it to :meth:`BfclSource.score` (JSON text of an
    OpenAI Chat Completions message; ``message.model_dump_json()`` of a real response is the same)."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return json.dumps(message)


def model_responses(answer: str | None) -> Any:
    """What BFCL records for ``answer``: ``OpenAICompletionsHandler._parse_query_response_FC`` on a
    Chat Completions response whose message is ``answer``.

    ``answer`` is the JSON text of the assistant message (an object with ``"role": "assistant"``).
    Any other text (prose, or ``None``: no answer) is taken as the message's text content.

    Returns:
        ``[{tool name: arguments JSON text}]`` when the message has tool calls, else its content.

    Raises:
        ValueError: ``answer`` is an assistant message object that is not a valid Chat Completions
            message (the message names the field).
    """
    api = bfcl_api()
    message: dict[str, Any] = {"role": "assistant", "content": answer}
    if answer is not None:
        try:
            parsed = json.loads(answer)
        except json.JSONDecodeError:
            parsed = None
        if isinstance(parsed, dict) and parsed.get("role") == "assistant":
            message = parsed
    completion = {
        "id": "flowopt-bfcl", "object": "chat.completion", "created": 0, "model": MODEL_NAME,
        "choices": [{"index": 0, "finish_reason": "tool_calls" if message.get("tool_calls") else "stop", "message": message}],
        "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
    }  # fmt: skip
    try:
        response = api.chat_completion.model_validate(completion)
    except Exception as exc:  # pydantic's ValidationError: its text names the field
        raise ValueError(f"the answer is not a Chat Completions assistant message: {exc}") from exc
    return api.handler._parse_query_response_FC(response)["model_responses"]


def bfcl_verdict(entry: BfclEntry, responses: Any) -> dict[str, Any]:
    """BFCL's evaluation of one recorded answer (:func:`model_responses`) to ``entry``: the dict
    ``eval_runner._evaluate_single_relevance_entry`` (``irrelevance``) or
    ``_evaluate_single_ast_entry`` (the others, ``Language.PYTHON``) returns; ``"valid"`` is the
    verdict, and an invalid one carries ``"error"`` and ``"error_type"``."""
    api = bfcl_api()
    if entry.category == "irrelevance":
        return api.evaluate_relevance_entry(api.handler, entry.bfcl_id, responses, {"id": entry.bfcl_id, "function": entry.functions},
                                            MODEL_NAME, entry.category)  # fmt: skip
    return api.evaluate_ast_entry(
        api.handler, entry.bfcl_id, responses, entry.ground_truth, {"id": entry.bfcl_id, "function": entry.functions},
        MODEL_NAME, entry.category, api.Language.PYTHON, api.ReturnFormat.PYTHON, has_tool_call_tag=False,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# the task source


@dataclass(frozen=True)
class BfclSourceConfig:
    """Attributes:
    categories: which of :data:`CATEGORIES` the tasks come from.
    held_out_percent: share of task ids (by sha256) in the held-out split (30: 367 of the 1240
        ids of the five categories, 24-33% of each).
    """

    categories: tuple[str, ...] = CATEGORIES
    held_out_percent: int = 30


class BfclSource:
    """BFCL v4's non-live AST questions, scored by BFCL's own evaluation (see the module docstring).

    ``tools`` is empty: every task carries its own in ``task.metadata["tools"]``, with the
    conversation's first messages in ``task.metadata["messages"]``.

    Raises (on construction):
        BfclUnavailable: bfcl-eval is not installed (``make install-bfcl``).
        ValueError: an unknown category, or a malformed entry (file, line and field named).
    """

    tools: tuple[dict[str, Any], ...] = ()

    def __init__(self, config: BfclSourceConfig | None = None):
        self.config = c = config or BfclSourceConfig()
        unknown = [name for name in c.categories if name not in CATEGORIES]
        if unknown:
            raise ValueError(f"unknown BFCL categories {unknown}; known: {list(CATEGORIES)}")
        self._entries: dict[str, BfclEntry] = {}
        self._tasks: list[Task] = []
        for category in c.categories:
            for entry in load_entries(category):
                task_id = f"bfcl-v4-{entry.bfcl_id}"
                demonstration = self._demonstration_answer(entry)
                self._entries[task_id] = entry
                self._tasks.append(
                    Task(
                        task_id=task_id,
                        query=entry.messages[-1]["content"],
                        reference=json.dumps(entry.ground_truth),
                        prompt=entry.messages[-1]["content"],
                        demonstration=demonstration,
                        split="held_out" if is_held_out(task_id, c.held_out_percent) else "train",
                        source=f"bfcl:{category}",
                        verifier="bfcl:irrelevance" if category == "irrelevance" else "bfcl:ast",
                        metadata={"bfcl_id": entry.bfcl_id, "category": category, "messages": entry.messages, "tools": entry.tools},
                    )
                )

    @staticmethod
    def _demonstration_answer(entry: BfclEntry) -> str:
        if entry.category == "irrelevance":
            return assistant_message(content=NO_CALL_ANSWER)
        return assistant_message(possible_answer_tool_calls(entry))

    def tasks(self, split: Split | None = None) -> list[Task]:
        """All tasks, or those of ``split``, category by category in file order."""
        return [t for t in self._tasks if split is None or t.split == split]

    def entry(self, task: Task) -> BfclEntry:
        """The BFCL entry of ``task``.

        Raises:
            KeyError: ``task`` is not from this source.
        """
        return self._entries[task.task_id]

    def score(self, task: Task, answer: str | None) -> float:
        """1.0 when BFCL's evaluation marks ``answer`` valid for ``task`` (:func:`bfcl_verdict` of
        :func:`model_responses`), else 0.0. ``answer`` is the assistant message as JSON text; prose
        or ``None`` counts as a message without tool calls (right on ``irrelevance`` tasks only). As
        in BFCL, calls whose arguments are not JSON fail to decode: wrong on AST tasks, and no call
        (right) on ``irrelevance`` tasks.

        Raises:
            KeyError: ``task`` is not from this source.
            ValueError: ``answer`` is an assistant message object that is not a valid Chat
                Completions message.
        """
        entry = self._entries[task.task_id]
        return 1.0 if bfcl_verdict(entry, model_responses(answer))["valid"] else 0.0

    def demonstration(self, task: Task) -> list[dict[str, Any]]:
        """An expert's conversation on ``task`` (OpenAI messages): the question, then BFCL's possible
        answer as tool calls (:func:`possible_answer_tool_calls`), or, on ``irrelevance`` tasks, a
        reply without a call (:data:`NO_CALL_ANSWER`). Scores 1.0 (``task.demonstration`` is its
        last message as JSON text)."""
        return [*self._entries[task.task_id].messages, json.loads(task.demonstration)]

