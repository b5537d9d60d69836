"""Prompt-policy rounds as Dagster assets: thin wrappers of :mod:`flow_assets.training.prompt_rounds`.

    [new_logs_sensor + log_batch_job]   the agent's flows through the proxy -> ... -> advantages
    prompt_round_job  (per batch, pool "training"; requested by prompt_round_sensor):
        prompt_candidate -> prompt_evaluation (+ blocking check prompt_gate) -> promoted_prompt

A batch gets a prompt round instead of a LoRA round when the champion in the registry is a prompt
policy, or a hosted policy whose round schedule (``FLOWOPT_ROUND_SCHEDULE``) gives this turn to the
prompt (``docs/training.md``, "Prompt-policy rounds"): one kind of change per round, so the gate always
compares one change. A hosted champion's candidates are its own LoRA adapter under each candidate
prompt, served by an in-process hosting gateway; a prompt policy's go through the proxy. The round's upstream calls (search and gate) are written to the lake's
``round_usage`` table under the batch, which the monthly budget counts
(:mod:`flow_assets.training.budget`).
"""


import json
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import polars as pl
from dagster import AssetCheckResult, AssetCheckSeverity, AssetCheckSpec, AssetExecutionContext, AssetObservation, Config, Failure, MaterializeResult, MetadataValue, asset
from pydantic import Field

from flow_assets.core.partitions import log_batches
from flow_assets.core.run_tags import GATE_DECISION_TAG, GATE_TAG, GateDecision
from flow_assets.core.versions import TRAINING_OWNERS, code_version
from flow_assets.data_plane.assets import advantages
from flow_assets.data_plane.checks import failed_data_checks
from flow_assets.logs.schema import Trajectory
from flow_assets.tasks.sources import Task
from flow_assets.policy.prompt import PromptPolicy, PromptPolicyError, hosted_version, policy_kind
from flow_assets.training.assets import POOL, _check_job_budget, champion
from flow_assets.training.budget import ROUND_USAGE_SCHEMA, ROUND_USAGE_TABLE
from flow_assets.training.champion import CHAMPION, champion_materialization
from flow_assets.training.prompt_rounds import (
    PromptRoundError,
    PromptRoundSettings,
    Usage,
    check_token_budget,
    gate_report,
    hosted_scores,
    landed_flows,
    proxy_scores,
    search_prompt,
    search_tasks_for,
    server_failures,
)
from resources.lake import TrajectoryLake
from resources.live_ab import LiveAB
from resources.policy import PolicyModel
from resources.registry import AdapterRegistry
from resources.tasks import TaskSourceResource
from resources.upstream import ReflectionEndpoint, UpstreamModel

GROUP = "prompt_policy"
GATE_CHECK = "prompt_gate"
_CODE = code_version("flow_assets.training.prompt_rounds", "flow_assets.policy.prompt", "flow_assets.policy.prompt_search", "flow_assets.serving.gateway")


class PromptRoundConfig(Config):
    """A prompt round's knobs (:class:`~flow_assets.training.prompt_rounds.PromptRoundSettings`)."""

    k: int = Field(3, ge=1, description="demonstrations per candidate")
    num_candidates: int = Field(4, ge=1, description="candidates besides the champion prompt")
    search_tasks: int = Field(32, ge=1, description="train tasks every candidate is scored on")
    heldout_tasks: int | None = Field(None, ge=1, description="held-out tasks of the gate (null: the whole split)")
    temperature: float = Field(0.5, ge=0.0, description="sampling temperature of search and gate")
    concurrency: int = Field(64, ge=1, description="agents at once per prompt")
    seed: int = Field(0, description="the candidates' and the search tasks' draw")
    min_score: float = Field(1.0, description="the least reward that makes a flow a demonstration")
    max_round_tokens: int | None = Field(None, ge=1, description="upstream tokens the round may spend (null: no cap)")
    alpha: float = Field(0.05, gt=0.0, lt=1.0, description="the gate's significance level")
    reflection_calls: int = Field(0, ge=0, description="task evaluations GEPA may spend rewriting the winner's instructions (0: none)")
    reflection_minibatch: int = Field(4, ge=1, description="train tasks per GEPA minibatch")

    def to_pure(self) -> PromptRoundSettings:
        """The pure settings."""
        return PromptRoundSettings(**self.model_dump())


def round_dir(registry: AdapterRegistry, key: str) -> Path:
    """Where the round of batch ``key`` keeps its candidates, scores and flows."""
    return Path(registry.root) / "prompt_rounds" / key


@dataclass(frozen=True)
class ChampionPrompt:
    """The champion a prompt round starts from.

    Attributes:
        version: its registry version.
        prompt: its prompt policy (an empty one for an adapter served without a prompt).
        adapter: its LoRA adapter directory when the policy is hosted (the candidates keep it and
            differ by the prompt only); ``None`` for a prompt policy alone (served by the proxy).
    """

    version: str
    prompt: PromptPolicy
    adapter: str | None


def champion_prompt(registry: AdapterRegistry) -> ChampionPrompt:
    """The champion's version, prompt policy and (hosted) adapter.

    Raises:
        PromptRoundError: no champion, or a prompt policy file that does not load.
    """
    champ = registry.champion()
    if champ is None:
        raise PromptRoundError("the registry has no champion")
    kind = policy_kind(champ["adapter_path"])
    try:
        prompt = PromptPolicy() if kind == "adapter" else PromptPolicy.load(champ["adapter_path"])
    except (OSError, PromptPolicyError) as exc:
        raise PromptRoundError(f"champion {champ['version']}: {exc}") from exc
    return ChampionPrompt(champ["version"], prompt, None if kind == "prompt" else champ["adapter_path"])


def _scorer(champ: ChampionPrompt, tasks: TaskSourceResource, upstream: UpstreamModel, registry: AdapterRegistry, policy: PolicyModel,
            settings: PromptRoundSettings):  # fmt: skip
    """``score(prompts, on, where) -> (rows, usage)``: the prompts' agents on tasks ``on``, sampled,
    through the proxy (a prompt policy) or a hosting gateway over the champion's adapter, their
    flows landed under ``where``."""
    source = tasks.source()

    def score(prompts: dict[str, PromptPolicy], on: Sequence[Task], where: Path):
        common = (prompts, on, source.score, tasks.agent_fn(), tasks.agent_id, {"sampled": settings.temperature}, settings.concurrency, where)
        if champ.adapter is not None:
            return hosted_scores(policy.store(), champ.adapter, *common)
        try:
            client = upstream.upstream()
        except ValueError as exc:
            raise PromptRoundError(str(exc)) from exc
        return proxy_scores(client, registry.path, *common)

    return score


def _record_usage(lake: TrajectoryLake, key: str, agent_id: str, step: str, usage: Usage) -> None:
    """One row per step of the round in the lake's ``round_usage`` (the step's row replaced on a re-run)."""
    try:
        kept = lake.read_partition(ROUND_USAGE_TABLE, key).filter(pl.col("step") != step)
    except FileNotFoundError:
        kept = pl.DataFrame(schema=ROUND_USAGE_SCHEMA)
    row = pl.DataFrame([{"agent_id": agent_id, "step": step, "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                         "prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
                         "trajectories": usage.trajectories, "unreported_turns": usage.unreported_turns}], schema=ROUND_USAGE_SCHEMA)  # fmt: skip
    lake.write_partition(ROUND_USAGE_TABLE, key, pl.concat([kept, row]))


def _usage_metadata(usage: Usage) -> dict:
    return {"upstream_prompt_tokens": usage.prompt_tokens, "upstream_completion_tokens": usage.completion_tokens,
            "usage_unreported_turns": usage.unreported_turns}  # fmt: skip


def _reflect(seed: PromptPolicy, search_on, score, reflection: ReflectionEndpoint, settings, scratch: Path):
    """GEPA on ``seed``'s instructions over the search tasks (train minibatches and validation alike)."""
    from flow_assets.training.prompt_reflection import reflect_instructions

    def run(policy: PromptPolicy, batch, where: Path):
        rows, usage = score({"gepa": policy}, batch, where)
        return rows, usage, landed_flows(where / "flows")

    return reflect_instructions(seed, search_on, search_on, run, reflection.client(), settings.reflection_calls, settings.reflection_minibatch,
                                scratch, settings.seed)  # fmt: skip


@asset(partitions_def=log_batches, group_name=GROUP, kinds={"json"}, deps=[advantages, champion], pool=POOL, owners=TRAINING_OWNERS, code_version=_CODE)
def prompt_candidate(
    context: AssetExecutionContext,
    config: PromptRoundConfig,
    lake: TrajectoryLake,
    tasks: TaskSourceResource,
    registry: AdapterRegistry,
    upstream: UpstreamModel,
    reflection: ReflectionEndpoint,
    policy: PolicyModel,
) -> MaterializeResult:
    """The best prompt found from this batch's flows: candidates (the champion prompt, and the
    champion plus k demonstrations drawn from the successful flows) scored on train tasks through
    the proxy to the upstream model, or for a hosted champion over its own LoRA adapter (DSPy's
    bootstrap few-shot with random search); then, with a
    reflection model and reflection_calls set, the winner's instructions rewritten by GEPA from
    the failures on the same tasks."""
    key = context.partition_key
    if failed := failed_data_checks(context.instance, key):
        raise Failure(f"batch {key!r} failed its blocking data checks {failed}: no prompt round")
    _check_job_budget(context, lake)
    settings, source = config.to_pure(), tasks.source()
    try:
        champ = champion_prompt(registry)
        version, prompt = champ.version, champ.prompt
        logs = lake.read_partition("interaction_logs", key).filter(pl.col("agent_id") == tasks.agent_id)
        flows = [Trajectory.model_validate_json(r) for r in logs["record_json"].to_list()]
        held_out_ids = [t.task_id for t in source.tasks("held_out")]
        search_on = search_tasks_for(source.tasks("train"), {f.task_id for f in flows if f.task_id}, settings.search_tasks, settings.seed)
        work = round_dir(registry, key)
        for old in ("search", "reflection", "candidate"):  # a re-run starts afresh: its flows are read back by task
            shutil.rmtree(work / old, ignore_errors=True)
        score = _scorer(champ, tasks, upstream, registry, policy, settings)
        found = search_prompt(prompt, flows, held_out_ids, search_on, lambda prompts: score(prompts, search_on, work / "search"), settings)
        _record_usage(lake, key, tasks.agent_id, "search", found.usage)
        check_token_budget(found.usage, settings, "search")
        best, spent, reflected = found.candidates[found.best], found.usage, None
        if settings.reflection_calls and reflection.enabled:
            reflected = _reflect(best, search_on, score, reflection, settings, work / "reflection")
            _record_usage(lake, key, tasks.agent_id, "reflection", reflected.usage)
            _record_usage(lake, key, tasks.agent_id, "reflection_model", Usage(*reflected.reflection_tokens, reflected.reflection_calls))
            spent = spent + reflected.usage + Usage(*reflected.reflection_tokens)
            check_token_budget(spent, settings, "reflection")
            best = reflected.policy
    except PromptRoundError as exc:
        raise Failure(str(exc)) from exc
    best_is_champion = found.best == 0 and not (reflected and reflected.improved)
    # a hosted candidate is the champion's adapter under the new prompt: one change
    path = best.save(work / "candidate") if champ.adapter is None else hosted_version(champ.adapter, best, work / "candidate")
    (work / "search.json").write_text(json.dumps({
        "champion": version, "best": found.best, "best_is_champion": best_is_champion, "mean_rewards": found.mean_rewards,
        "demonstrations": found.demonstrations, "search_task_ids": found.search_task_ids, "candidate_path": str(path),
        "content_hash": best.content_hash, "usage": {"prompt_tokens": spent.prompt_tokens, "completion_tokens": spent.completion_tokens},
        "server_failures": server_failures(work / "search"),
        "reflection": None if reflected is None else {"improved": reflected.improved, "val_scores": reflected.val_scores,
                                                      "instructions": reflected.instructions, "metric_calls": reflected.metric_calls,
                                                      "reflection_calls": reflected.reflection_calls},
    }, indent=1))  # fmt: skip
    context.log.info(f"{len(flows)} flows, {found.demonstrations} demonstrations; {len(found.candidates)} candidates on {len(search_on)} train "
                     f"tasks: mean reward {found.mean_rewards}; best c{found.best}")  # fmt: skip
    return MaterializeResult(metadata={
        "champion": version, "flows": len(flows), "demonstrations": found.demonstrations, "candidates": len(found.candidates),
        "mean_rewards": MetadataValue.json(found.mean_rewards), "best": found.best, "best_is_champion": best_is_champion,
        "candidate": MetadataValue.path(str(path)), "content_hash": best.content_hash, "search_tasks": len(search_on),
        **_usage_metadata(spent),
        **({} if reflected is None else {
            "reflection_improved": reflected.improved, "reflection_val_scores": MetadataValue.json(reflected.val_scores),
            "reflection_metric_calls": reflected.metric_calls, "reflection_model_calls": reflected.reflection_calls,
        }),
    })  # fmt: skip


@asset(partitions_def=log_batches, group_name=GROUP, kinds={"json"}, deps=[prompt_candidate], pool=POOL, owners=TRAINING_OWNERS, code_version=_CODE,
       check_specs=[AssetCheckSpec(GATE_CHECK, asset="prompt_evaluation", blocking=True,
                                   description="the candidate prompt gains on the held-out split, sampled, with McNemar p < alpha")])  # fmt: skip
def prompt_evaluation(
    context: AssetExecutionContext,
    config: PromptRoundConfig,
    lake: TrajectoryLake,
    tasks: TaskSourceResource,
    registry: AdapterRegistry,
    upstream: UpstreamModel,
    policy: PolicyModel,
) -> MaterializeResult:
    """Champion prompt vs candidate prompt on the same held-out tasks, sampled, through the proxy
    to the upstream (or over the champion's own LoRA adapter, for a hosted champion); the blocking check prompt_gate (gain, McNemar p) decides whether promotion
    may run. A search whose best candidate was the champion itself spends nothing here."""
    key = context.partition_key
    settings, source, work = config.to_pure(), tasks.source(), round_dir(registry, key)
    search = json.loads((work / "search.json").read_text())
    usage = Usage()
    try:
        champ = champion_prompt(registry)
        version, prompt = champ.version, champ.prompt
        if version != search["champion"]:
            raise PromptRoundError(f"the champion is {version} now, the candidate was searched from {search['champion']}: run the round again")
        candidate = PromptPolicy.load(search["candidate_path"])
        if search["best_is_champion"]:
            report = {"champion": None, "candidate": None, "gain": 0.0, "mcnemar_p": 1.0, "n_tasks": 0, "server_failures": {}, "passed": False,
                      "reason": "no candidate beat the champion prompt on the search tasks"}  # fmt: skip
        else:
            held_out = source.tasks("held_out")[: settings.heldout_tasks]
            shutil.rmtree(work / "gate", ignore_errors=True)
            score = _scorer(champ, tasks, upstream, registry, policy, settings)
            rows, usage = score({"champion": prompt, "candidate": candidate}, held_out, work / "gate")
            _record_usage(lake, key, tasks.agent_id, "gate", usage)
            lake.write_partition("prompt_evaluations", key, rows)
            report = gate_report(rows, settings.alpha, candidate_is_champion=False, failures=server_failures(work / "gate"))
            spent = Usage(search["usage"]["prompt_tokens"], search["usage"]["completion_tokens"]) + usage
            try:
                check_token_budget(spent, settings, "gate")
            except PromptRoundError as exc:
                report |= {"passed": False, "reason": str(exc)}
    except (PromptRoundError, OSError, PromptPolicyError) as exc:
        raise Failure(str(exc)) from exc
    report |= {"champion_version": version, "content_hash": candidate.content_hash, "candidate_path": search["candidate_path"]}
    (work / "gate.json").write_text(json.dumps(report, indent=1))
    decision = f"prompt candidate of batch {key}: {'passed' if report['passed'] else 'blocked'} ({report['reason']})"
    context.instance.add_run_tags(context.run_id, {GATE_TAG: decision[:200], GATE_DECISION_TAG: GateDecision.of(not report["passed"]).value})
    if not report["passed"]:
        context.log.warning(f"gate: {decision}")
        context.log_event(AssetObservation(asset_key=CHAMPION, description=decision,
                                           metadata={"version": version, "action": "kept", "candidate_batch": key, "verdict": decision}))  # fmt: skip
    numbers = {name: MetadataValue.float(float(report[name])) for name in ("champion", "candidate", "gain", "mcnemar_p") if report[name] is not None}
    return MaterializeResult(
        metadata={**numbers, "held_out_tasks": report["n_tasks"], "verdict": decision, **_usage_metadata(usage)},
        check_results=[AssetCheckResult(check_name=GATE_CHECK, passed=bool(report["passed"]), severity=AssetCheckSeverity.ERROR,
                                        description=report["reason"], metadata={**numbers, "champion_version": version})],  # fmt: skip
    )


@asset(partitions_def=log_batches, group_name=GROUP, kinds={"json"}, deps=[prompt_evaluation], pool=POOL, owners=TRAINING_OWNERS, code_version=_CODE)
def promoted_prompt(context: AssetExecutionContext, registry: AdapterRegistry, live_ab: LiveAB) -> MaterializeResult:
    """The candidate prompt becomes the champion (a new registry version, its prompt saved under
    prompts/<version> of the models directory; a hosted one, the champion's adapter under the new
    prompt, under adapters/<version>), or with live A/B on the challenger, which
    ab_test_report and ab_monitor_sensor decide on live traffic as for adapters. Refuses a
    candidate searched from a champion that has since changed."""
    key = context.partition_key
    report = json.loads((round_dir(registry, key) / "gate.json").read_text())
    if not report["passed"]:
        raise Failure(f"the prompt gate did not pass: {report['reason']}")
    champ = registry.champion()
    if champ is None or champ["version"] != report["champion_version"]:
        raise Failure(f"the champion changed since the gate ({report['champion_version']} -> {champ and champ['version']}): not promoted")
    version = registry.next_version()
    candidate = Path(report["candidate_path"])
    if policy_kind(candidate) == "prompt":
        path = str(PromptPolicy.load(candidate).save(Path(registry.root) / "prompts" / version))
    else:
        target = Path(registry.root) / "adapters" / version
        shutil.rmtree(target, ignore_errors=True)
        path = str(shutil.copytree(candidate, target))
    metrics = {"heldout": {k: report[k] for k in ("champion", "candidate", "gain", "mcnemar_p", "n_tasks")}, "content_hash": report["content_hash"], "batch": key}
    reason = f"prompt round on batch {key}: {report['reason']}"
    by = f"dagster run {context.run_id} (partition {key})"
    if live_ab.enabled:
        registry.start_challenger(version, path, metrics, live_ab.share, by=by, reason=reason)
        text = f"{version} enters live A/B against {champ['version']} ({live_ab.share:.0%} of sessions)"
        context.log.info(text)
        context.log_event(AssetObservation(asset_key=CHAMPION, description=text, metadata={"version": champ["version"], "challenger": version, "share": live_ab.share}))
    else:
        registry.promote(version, path, metrics, by=by, reason=reason)
        context.log_event(champion_materialization(registry.load()))
    return MaterializeResult(metadata={"version": version, "previous": champ["version"], "challenger": live_ab.enabled,
                                       "prompt": MetadataValue.path(path), "reason": reason})  # fmt: skip


prompt_assets = [prompt_candidate, prompt_evaluation, promoted_prompt]
