"""flowopt: reinforcement learning on LLM agents' own execution flows, as a Dagster code location.
Commands: demo, demo-real, demo-bfcl, bfcl-entry-point, demo-logs, demo-text, demo-prompt, ingest PATH..., serve, models, registry, promote, rollback, proposals, schema, ui-tour."""

from __future__ import annotations

import argparse
import getpass
import json
import sys
from pathlib import Path

from flow_assets.runtime.local import local_instance
from flow_assets.logs.reader import known_formats
from flow_assets.policy.configs import SERVE_MAX_TOKENS
from flow_assets.settings import DEFAULT_DAGSTER_URL, DEFAULT_LANDING, DEFAULT_MODELS, Settings
from resources.lake import TrajectoryLake


def _ingest(args: argparse.Namespace, settings: Settings) -> int:
    from flow_assets.definitions import build_definitions
    from flow_assets.logs.ingest import EXIT_USAGE, IngestUsageError, exit_code, ingest_files, resolve_arguments

    try:
        files = resolve_arguments(args.paths, args.source)
    except IngestUsageError as exc:
        for problem in exc.problems:
            print(f"flowopt ingest: {problem}", file=sys.stderr)
        print("flowopt ingest: nothing was ingested", file=sys.stderr)
        return EXIT_USAGE
    # the same settings as the code location (flow_assets/definitions.py), so both see one lake
    landing = Path(args.landing or settings.landing)
    lake_root = Path(args.lake or settings.lake)
    instance = local_instance(args.home or settings.dagster_home)
    defs = build_definitions(str(lake_root), str(landing), settings=settings)
    results = ingest_files(
        files, defs=defs, instance=instance, lake=TrajectoryLake(root=str(lake_root)), landing=landing,
        fmt=args.format, force=args.force, replace=args.replace, log_level="INFO" if args.verbose else "CRITICAL",
    )  # fmt: skip
    report = {"dagster_home": str(instance.root_directory), "lake": str(lake_root), "files": [r.row() for r in results]}
    print(json.dumps(report, indent=2))
    for result in results:
        if result.status != "ingested" or result.message:
            print(f"flowopt ingest: {result.file}: {result.status.replace('_', ' ')}: {result.message}", file=sys.stderr)
        if args.verbose and result.traceback:
            print(result.traceback, file=sys.stderr)
    return exit_code(results)


def _demo(args: argparse.Namespace, settings: Settings) -> int:
    from flow_assets.demo.state import DemoState, DemoStateError
    from flow_assets.demo.run import run_demo

    try:
        run_demo(DemoState.from_settings(settings, args.state), reset=args.reset, settings=settings)
    except (DemoStateError, FileNotFoundError) as exc:
        print(f"flowopt demo: {exc}", file=sys.stderr)
        return 2
    return 0


def _demo_real(args: argparse.Namespace, settings: Settings) -> int:
    from flow_assets.demo.real import run_real_demo
    from flow_assets.policy.presets import PresetUnavailable

    try:
        run_real_demo(rounds=args.rounds, final_tasks=args.final_tasks, settings=settings)
    except PresetUnavailable as exc:
        print(f"flowopt demo-real: {exc}", file=sys.stderr)
        return 2
    return 0


def _demo_bfcl(args: argparse.Namespace, settings: Settings) -> int:
    from flow_assets.demo.bfcl import run_bfcl_demo
    from flow_assets.policy.presets import PresetUnavailable
    from flow_assets.tasks.bfcl import BfclUnavailable

    try:
        run_bfcl_demo(rounds=args.rounds, final_tasks=args.final_tasks, modes=tuple(args.modes.split(",")), eval_dtype=args.eval_dtype,
                      settings=settings)  # fmt: skip
    except (PresetUnavailable, BfclUnavailable) as exc:
        print(f"flowopt demo-bfcl: {exc}", file=sys.stderr)
        return 2
    return 0


def _bfcl_entry_point(args: argparse.Namespace, settings: Settings) -> int:
    from pathlib import Path

    from flow_assets.demo.bfcl_entry import BfclCliUnavailable, run_bfcl_entry_point
    from flow_assets.policy.presets import PresetUnavailable
    from flow_assets.tasks.bfcl import BfclUnavailable

    try:
        run_bfcl_entry_point(adapter=Path(args.adapter).resolve() if args.adapter else None, tasks_limit=args.tasks, dtype=args.dtype,
                             settings=settings)  # fmt: skip
    except (PresetUnavailable, BfclUnavailable, BfclCliUnavailable, FileNotFoundError) as exc:
        print(f"flowopt bfcl-entry-point: {exc}", file=sys.stderr)
        return 2
    return 0


def _demo_logs(args: argparse.Namespace, settings: Settings) -> int:
    from pathlib import Path

    from flow_assets.demo.logs import run_logs_demo
    from flow_assets.demo.state import DemoStateError
    from flow_assets.policy.presets import PresetUnavailable

    try:
        run_logs_demo(root=Path(args.state).resolve(), family=args.family, settings=settings)
    except (PresetUnavailable, DemoStateError) as exc:
        print(f"flowopt demo-logs: {exc}", file=sys.stderr)
        return 2
    return 0


def _demo_prompt(args: argparse.Namespace, settings: Settings) -> int:
    from pathlib import Path

    from flow_assets.demo.prompt_round import run_prompt_round
    from flow_assets.policy.presets import PresetUnavailable
    from flow_assets.runtime.deployment import DeploymentError

    try:
        run_prompt_round(root=Path(args.state).resolve(), start_examples=args.start_examples, final_tasks=args.final_tasks,
                         collect_tasks=args.collect_tasks, search_tasks=args.search_tasks, num_candidates=args.candidates, k=args.k,
                         modes=("sampled", "greedy") if args.greedy else ("sampled",), live_ab=not args.no_live_ab,
                         under_daemon=not (args.in_process or args.greedy))  # fmt: skip
    except (PresetUnavailable, ValueError, DeploymentError) as exc:
        print(f"flowopt demo-prompt: {exc}", file=sys.stderr)
        return 2
    return 0


def _demo_text(args: argparse.Namespace, settings: Settings) -> int:
    from pathlib import Path

    from flow_assets.demo.state import DemoStateError
    from flow_assets.demo.text_compare import run_text_comparison
    from flow_assets.policy.presets import PresetUnavailable

    try:
        run_text_comparison(root=Path(args.state).resolve(), final_tasks=args.final_tasks, settings=settings,
                            modes=("sampled",) if args.sampled_only else ("sampled", "greedy"), resume=args.resume)  # fmt: skip
    except (PresetUnavailable, DemoStateError) as exc:
        print(f"flowopt demo-text: {exc}", file=sys.stderr)
        return 2
    return 0


def _serve(args: argparse.Namespace, settings: Settings) -> int:
    from flow_assets.serving.gateway.config import GatewayConfig
    from flow_assets.serving.gateway.guard import RequestLimits
    from flow_assets.serving.gateway.server import check_bind, gateway_tokens
    from flow_assets.serving.gateway.serve import make_gateway
    from flow_assets.policy.store import PolicyStore

    from flow_assets.logs.ingest import check_source

    if bad := check_source(args.source):
        print(f"flowopt serve: {bad}", file=sys.stderr)
        return 2
    if args.max_batch_total_tokens is not None and args.max_batch_total_tokens < 1:
        print(f"flowopt serve: --max-batch-total-tokens must be at least 1, got {args.max_batch_total_tokens}", file=sys.stderr)
        return 2
    try:  # before the model loads: a refusal is immediate
        tokens = gateway_tokens(args.tokens_file, settings)
        check_bind(args.host, tokens)
        limits = RequestLimits(int(args.max_body_mb * 1024 * 1024), args.body_timeout)
    except OSError as exc:
        print(f"flowopt serve: --tokens-file: {exc.strerror or exc}: {args.tokens_file}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"flowopt serve: {exc}", file=sys.stderr)
        return 2
    models, landing = args.models or settings.models, args.landing or settings.landing
    config = GatewayConfig(
        default_max_tokens=args.max_tokens,
        batch_max_trajectories=args.batch_size,
        batch_flush_seconds=args.flush_seconds,
        rollout_timeout_s=args.rollout_timeout,
        source=args.source,
        limits=limits,
        max_batch_total_tokens=args.max_batch_total_tokens,
    )
    if args.upstream:
        return _serve_upstream(args, settings, config, models, landing, tokens)
    base_model = args.base_model
    if args.preset:
        from flow_assets.policy.presets import PresetUnavailable, prepare_model

        try:
            base_model = prepare_model(args.preset, preset_dir(args.preset, models)).path
        except (KeyError, PresetUnavailable) as exc:
            print(f"flowopt serve: --preset: {exc.args[0]}", file=sys.stderr)
            return 2
    store = PolicyStore(models_root=models, base_model_path=base_model, max_new_tokens=args.max_tokens)
    if not store.base_path.is_dir():
        print(f"flowopt serve: no base model at {store.base_path} (run `make demo`, or pass --base-model or --preset)", file=sys.stderr)
        return 2
    if registered := ensure_champion(store):
        print(f"flowopt serve: {store.base_path} registered as champion v0 (an identity LoRA adapter at {registered})", flush=True)
    gateway = make_gateway(store, landing, config=config)
    return _announce_and_serve(gateway, args, tokens, f"serving {', '.join(gateway.resolver.names())}; rollouts land in {Path(landing) / args.source}")


def _announce_and_serve(gateway, args: argparse.Namespace, tokens: list[str], what: str) -> int:
    """Print where the gateway listens and what it does, then serve until interrupted."""
    from flow_assets.serving.gateway.server import serve_forever

    auth = f"{len(tokens)} bearer token(s) required" if tokens else "no token required (loopback only)"
    print(f"flowopt gateway: http://{args.host}:{args.port}/v1 {what}; {auth}", flush=True)
    serve_forever(gateway, args.host, args.port, tokens)
    return 0


def _serve_upstream(args: argparse.Namespace, settings: Settings, config, models: str, landing: str, tokens: list[str]) -> int:
    """``flowopt serve --upstream URL``: proxy mode (``flow_assets.serving.gateway.upstream``); no
    model loads here. The key is ``settings.upstream_api_key`` ($FLOWOPT_UPSTREAM_API_KEY), never printed."""
    from flow_assets.serving.gateway.app import Gateway
    from flow_assets.serving.gateway.engine import AdapterResolver
    from flow_assets.serving.gateway.upstream import Upstream
    from flow_assets.policy.store import PolicyStore

    if args.preset or args.base_model:
        print("flowopt serve: --upstream forwards to a model server; it takes no --preset or --base-model", file=sys.stderr)
        return 2
    try:
        upstream = Upstream(args.upstream, args.upstream_model, settings.upstream_api_key, args.upstream_timeout)
    except ValueError as exc:
        print(f"flowopt serve: --upstream: {exc}", file=sys.stderr)
        return 2
    store = PolicyStore(models_root=models)
    gateway = Gateway(None, AdapterResolver(store.registry_path), landing, config, upstream=upstream)
    key = "key from $FLOWOPT_UPSTREAM_API_KEY" if upstream.api_key else "no key ($FLOWOPT_UPSTREAM_API_KEY is not set)"
    return _announce_and_serve(gateway, args, tokens, f"forwarding to {upstream.base_url} (model {upstream.model or 'as asked'}; {key}); "
                               f"rollouts land in {Path(landing) / args.source} as text")  # fmt: skip


def ensure_champion(store) -> str | None:
    """Register ``store``'s base model as champion ``v0`` (an identity LoRA adapter) when its
    models directory has no registry yet, so ``flowopt serve`` serves a model a user brings with
    nothing else to run; returns the adapter's directory, or ``None`` when a registry exists."""
    from flow_assets.training.rounds import register_identity_adapter
    from resources.registry import AdapterRegistry

    if store.registry_path.exists():
        return None
    return register_identity_adapter(store, AdapterRegistry(root=str(store.models_root)), by="flowopt serve", reason="the base model as given")


def preset_dir(name: str, models: str | Path = DEFAULT_MODELS) -> Path:
    """Where ``flowopt models prepare NAME`` puts a preset by default: ``<models>/presets/<name>``."""
    return Path(models) / "presets" / name


def _models_prepare(args: argparse.Namespace, settings: Settings) -> int:
    from flow_assets.policy.presets import PresetUnavailable, prepare_model

    target = Path(args.dir) if args.dir else preset_dir(args.preset)
    try:
        prepared = prepare_model(args.preset, target, force=args.force)
    except (KeyError, PresetUnavailable) as exc:
        print(f"flowopt models prepare: {exc.args[0]}", file=sys.stderr)
        return 2
    print(json.dumps({**vars(prepared), "use": f"FLOWOPT_BASE_MODEL={prepared.path}"}, indent=2))
    return 0


def _models_list(args: argparse.Namespace, settings: Settings) -> int:
    from flow_assets.policy.presets import PRESETS, PresetUnavailable, find_gguf, is_prepared

    for preset in PRESETS.values():
        try:
            find_gguf(preset)
            installed = "installed"
        except PresetUnavailable:
            installed = f"not installed (pip install -e '.[{preset.extra}]')"
        where = preset_dir(preset.name)
        prepared = f"prepared at {where}" if is_prepared(where, preset.name) else "not prepared"
        print(f"{preset.name}: {preset.description}; {installed}; {prepared}")
    return 0


def _rollback(args: argparse.Namespace, settings: Settings) -> int:
    from resources.registry import AdapterRegistry, RegistryError

    registry = AdapterRegistry(root=args.models or settings.models)
    try:
        before, challenger = registry.champion(), registry.challenger()
        if challenger:  # during live A/B, "roll back" means: withdraw the challenger
            after = registry.conclude_challenger("rollback", by=args.by or getpass.getuser(), reason=args.reason)
        else:
            after = registry.rollback(by=args.by, reason=args.reason)
    except RegistryError as exc:
        print(f"flowopt rollback: {exc}", file=sys.stderr)
        return 1
    _report_champion(registry, args.home, "rollback", settings)
    out = {"previous_champion": before["version"], "champion": after["version"], "adapter_path": after["adapter_path"]}
    print(json.dumps(out | ({"withdrawn_challenger": challenger["version"]} if challenger else {})))
    return 0


def _promote(args: argparse.Namespace, settings: Settings) -> int:
    from resources.registry import AdapterRegistry, RegistryError

    registry = AdapterRegistry(root=args.models or settings.models)
    try:
        before, challenger = registry.champion(), registry.challenger()
        if not challenger:
            raise RegistryError(f"{registry.path}: no challenger in live A/B (a candidate reaches the champion through the held-out gate)")
        after = registry.conclude_challenger("promote", by=args.by or getpass.getuser(), reason=args.reason)
    except RegistryError as exc:
        print(f"flowopt promote: {exc}", file=sys.stderr)
        return 1
    _report_champion(registry, args.home, "promote", settings)
    print(json.dumps({"previous_champion": before["version"], "champion": after["version"], "adapter_path": after["adapter_path"]}))
    return 0


def _report_champion(registry, home: str | None, command: str, settings: Settings) -> None:
    # the UI's `champion` asset shows a change made here beside the promotions made by runs; an
    # instance is opened only where one was named (variable, project settings file, --home),
    # never the default directory
    home = home or (settings.dagster_home if settings.is_set("dagster_home") else None)
    if home:
        from flow_assets.training.champion import champion_materialization

        local_instance(home).report_runless_asset_event(champion_materialization(registry.load()))
    else:
        print(f"flowopt {command}: not recorded in a Dagster instance (set DAGSTER_HOME, dagster_home in .flowopt.toml, or --home)", file=sys.stderr)


def _registry_rebuild(args: argparse.Namespace, settings: Settings) -> int:
    from resources.registry import AdapterRegistry, RegistryError

    try:
        content = AdapterRegistry(root=args.models or settings.models).rebuild()
    except RegistryError as exc:
        print(f"flowopt registry rebuild: {exc}", file=sys.stderr)
        return 1
    print(json.dumps({"champion": (content["champion"] or {}).get("version"), "events": len(content["history"])}))
    return 0


def _registry_show(args: argparse.Namespace, settings: Settings) -> int:
    from resources.registry import AdapterRegistry, RegistryError

    registry = AdapterRegistry(root=args.models or settings.models)
    try:
        content = registry.load()
    except RegistryError as exc:
        print(f"flowopt registry show: {exc}", file=sys.stderr)
        return 1
    print(json.dumps({k: content.get(k) for k in ("champion", "challenger", "candidate")} | {"events": len(content["history"])}, indent=2))
    return 0


def _bus_config(args: argparse.Namespace, settings: Settings):
    from flow_assets.bus.consumer import BusConfig

    return BusConfig(
        url=args.url or settings.amqp_url,
        landing=Path(getattr(args, "landing", None) or settings.landing),
        queue_prefix=args.queue_prefix,
        **{k: v for k, v in vars(args).items() if k in ("tap", "exchange_type", "max_records", "window_s", "unlabelled_timeout_s", "task_ttl_s",
                                                        "prefetch", "idle_exit_s", "max_message_bytes", "max_depth")},
    )  # fmt: skip


def _bus_declare(args: argparse.Namespace, settings: Settings) -> int:
    import pika.exceptions

    from flow_assets.bus.consumer import BusTopologyError, declare

    config = _bus_config(args, settings)
    try:
        declared = declare(config)
    except (pika.exceptions.AMQPConnectionError, BusTopologyError) as exc:
        print(f"flowopt bus declare: {config.url.split('@')[-1]}: {exc!r}", file=sys.stderr)
        return 1
    print(json.dumps([{"exchange": e, "type": config.exchange_type, "tap_queue": q} for e, q in declared], indent=2))
    return 0


def _bus_consume(args: argparse.Namespace, settings: Settings) -> int:
    import pika.exceptions

    from flow_assets.bus.consumer import BusConsumer, BusTopologyError

    config = _bus_config(args, settings)
    taps = ", ".join(f"{config.exchange(k)} -> {config.queue(k)}" for k in ("tasks", "responses", "rewards"))
    print(f"flowopt bus consume: {config.url.split('@')[-1]} {config.exchange_type} exchanges -> tap queues {taps}; lands in {config.landing / 'bus'}",
          file=sys.stderr, flush=True)  # fmt: skip
    try:
        stats = BusConsumer(config).run()
    except pika.exceptions.AMQPConnectionError as exc:
        print(f"flowopt bus consume: cannot reach the broker at {config.url.split('@')[-1]}: {exc!r}", file=sys.stderr)
        return 1
    except BusTopologyError as exc:
        print(f"flowopt bus consume: {exc}", file=sys.stderr)
        return 1
    print(json.dumps({**vars(stats), "landing": str(config.landing / "bus")}, indent=2))
    return 0


def _bus_publish(args: argparse.Namespace, settings: Settings) -> int:
    import pika.exceptions

    from flow_assets.bus.consumer import BusTopologyError, publish

    config = _bus_config(args, settings)
    messages = []
    for number, line in enumerate(Path(args.file).read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            messages.append((item["queue"], item.get("message_id") or f"{Path(args.file).name}:{number}", item["body"]))
        except (ValueError, KeyError, TypeError) as exc:
            print(f"flowopt bus publish: {args.file}, line {number}: expected {{\"queue\", \"message_id\", \"body\"}}: {exc!r}", file=sys.stderr)
            return 2
    try:
        sent = publish(config.url, messages, config=config)
    except (ValueError, BusTopologyError, pika.exceptions.AMQPConnectionError) as exc:
        print(f"flowopt bus publish: {args.file}: {exc!r}", file=sys.stderr)
        return 1
    print(json.dumps({"published": sent}))
    return 0


def _api(args: argparse.Namespace, settings: Settings) -> int:
    import uvicorn

    from flow_assets.api.server import Limits, create_app, deployment_service, training_dispatcher

    tokens = list(settings.api_tokens)
    if not tokens:
        print("flowopt api: set FLOWOPT_API_TOKENS (comma-separated bearer tokens); without one every call is refused", file=sys.stderr)
        return 2
    import logging

    # the API's events are JSON lines already: written as they are, to stderr
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    events = logging.getLogger("flowopt.api")
    events.addHandler(handler)
    events.setLevel(logging.INFO)
    events.propagate = False
    instance = local_instance(args.home or settings.dagster_home)
    service = deployment_service(instance, args.dagster_url or settings.dagster_url, settings=settings)
    exports = settings.exports
    try:
        limits = Limits(max_body_bytes=int(args.max_body_mb * 1024 * 1024), body_timeout_s=args.body_timeout_s, max_batch=args.max_batch)
    except ValueError as exc:
        print(f"flowopt api: {exc}", file=sys.stderr)
        return 2
    app = create_app(training_dispatcher(service, exports, limits.max_batch), tokens, service, exports, limits)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    return 0


def _proposals(args: argparse.Namespace, settings: Settings) -> int:
    from flow_assets.workflows.definition import WorkflowError, WorkflowStore
    from flow_assets.workflows.review import ProposalBoard, ProposalNotFound, ReviewRefused

    board = ProposalBoard(WorkflowStore(args.workflows or settings.workflows))
    command = f"flowopt proposals {args.proposals_command}"
    try:
        if args.proposals_command == "list":
            found = board.find(status=None if args.status == "all" else args.status, agent_id=args.agent)
            if args.json:
                print(json.dumps([p.model_dump(mode="json", exclude={"evidence"}) for p in found], indent=2, ensure_ascii=False))
                return 0
            if not found:
                print(f"no {'' if args.status == 'all' else args.status + ' '}proposals in {board.proposals_dir}", file=sys.stderr)
            for p in found:
                e = p.evidence
                print(f"{p.id}  {p.status:10} {p.agent_id}  v{p.base_version}  {p.rule}  {p.step_id}  "
                      f"effect {e.effect:+.3f} [{e.effect_low:+.3f}, {e.effect_high:+.3f}]  n={e.n_trajectories}\n    {p.summary}")  # fmt: skip
            return 0
        if args.proposals_command == "show":
            proposal = board.get(args.id)
            current = board.store.current(proposal.agent_id)
            refusal = board.check(args.id)
            shown = proposal.model_dump(mode="json") | {
                "current_version": current.version if current else None,
                "applies_now": refusal is None,
                **({"would_be_refused": refusal} if refusal else {}),
            }
            print(json.dumps(shown, indent=2, ensure_ascii=False))
            return 0
        if args.proposals_command == "verify":
            problems = board.verify_audit()
            for problem in problems:
                print(f"{command}: {problem}", file=sys.stderr)
            lines = len(board.audit())
            print(json.dumps({"audit_log": str(board.audit_path), "entries": lines, "intact": not problems, "problems": len(problems)}))
            return 1 if problems else 0
        by = args.by or getpass.getuser()
        if args.proposals_command == "approve":
            proposal, saved = board.approve(args.id, by=by, reason=args.reason)
            out = {"proposal": proposal.id, "status": proposal.status, "agent_id": saved.agent_id, "version": saved.version,
                   "previous_version": saved.change.previous_version, "workflow": str(board.store.path(saved.agent_id))}  # fmt: skip
        else:
            proposal = board.reject(args.id, by=by, reason=args.reason)
            out = {"proposal": proposal.id, "status": proposal.status, "agent_id": proposal.agent_id, "reason": args.reason}
    except ProposalNotFound:
        print(f"{command}: no proposal {args.id!r} in {board.proposals_dir}", file=sys.stderr)
        return 2
    except (ReviewRefused, WorkflowError) as exc:
        print(f"{command}: refused: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(out, ensure_ascii=False))
    return 0


def _daemon(args: argparse.Namespace, settings: Settings) -> int:
    from flow_assets.runtime.daemon import run_daemon

    return run_daemon(args.daemon_args, settings.sensor_loop_seconds, settings.run_watch_seconds, settings.sensor_interval_seconds)


def _schema(args: argparse.Namespace, settings: Settings) -> int:
    from flow_assets.logs.schema import json_schema

    print(json.dumps(json_schema(), indent=2, ensure_ascii=False))
    return 0


#: the sub-commands that load a model in their own process (the demos, the gateway, GGUF
#: conversion): only they import transformers to quiet it, ~0.9 s of CPU that every other
#: command paid too (`flowopt ingest` of the 4 MB tau-bench log: 5.4-5.6 s before, 4.1-4.5 s
#: after, 2026-11-29)
MODEL_COMMANDS = frozenset({"demo", "demo-real", "demo-bfcl", "demo-logs", "demo-text", "demo-prompt", "bfcl-entry-point", "serve", "models"})


def _quiet_libraries(loads_models: bool) -> None:
    # the tiny model is loaded many times per round; progress bars and deprecation notes drown
    # the lines a person reads. Called once, at start-up, before any thread runs.
    import warnings

    if loads_models:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module="dagster")


def _ui_tour(args: argparse.Namespace, settings: Settings) -> int:
    from flow_assets.demo.state import DemoState
    from flow_assets.demo.ui_tour import TourError, tour

    state = DemoState.from_settings(settings, args.state)
    env = {"DAGSTER_HOME": str(state.home), "FLOWOPT_LAKE": str(state.lake), "FLOWOPT_LANDING": str(state.landing), "FLOWOPT_MODELS": str(state.models),
           "FLOWOPT_WORKFLOWS": str(state.workflows)}  # fmt: skip
    try:
        result = tour(env, Path(args.out), settings=settings)
    except TourError as exc:
        print(f"flowopt ui-tour: {exc}", file=sys.stderr)
        return 2
    for name, proof in result.found.items():
        print(f"{'found' if proof else 'MISSING':8} {name}" + (f": {proof[:120]}" if proof and proof != name else ""))
    print("screenshots: " + ", ".join(str(p) for p in result.screenshots))
    required = [m for m in result.missing if m != "a blocked round's reason"]  # a run may promote every round
    return 1 if required else 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``flowopt`` console script; returns the process exit code."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    _quiet_libraries(args.command in MODEL_COMMANDS)
    if unknown and args.command != "daemon":
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command == "daemon":  # dagster-daemon's own options, e.g. --version, that argparse left over
        args.daemon_args = unknown + args.daemon_args
    try:  # once, after the arguments (so --help works whatever the environment holds)
        settings = Settings.load()
    except ValueError as exc:
        print(f"flowopt {args.command}: {exc}", file=sys.stderr)
        return 2
    return args.fn(args, settings)


def build_parser() -> argparse.ArgumentParser:
    """The ``flowopt`` command line: every sub-command and its options (e.g. to check a
    deployment's commands without running them)."""
    parser = argparse.ArgumentParser(prog="flowopt", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="run the main job end to end on the real logs (local instance)",
        description="Run the main job end to end: the real logs through the data plane, then two agents trained in rounds. "
        "State goes to DAGSTER_HOME / FLOWOPT_LAKE / FLOWOPT_LANDING / FLOWOPT_MODELS where set, else under --state. "
        "Each run clears the state it created before (marked .flowopt-demo); anything else is deleted only with --reset. "
        "It records where its state is in .flowopt.toml here (the project settings file; one a person wrote is left alone), "
        "so flowopt proposals / serve / promote / rollback / api / ingest and make ui run from here find it. "
        "Exit code 2: the logs are missing or the state is not the demo's (nothing changed).",
    )
    demo.add_argument("--state", default=".demo", help="directory of the demo's own state (default .demo)")
    demo.add_argument("--reset", action="store_true", help="also delete state the demo did not create")
    demo.set_defaults(fn=_demo)
    ui = sub.add_parser(
        "ui-tour",
        help="open the Dagster UI of the demo (or DAGSTER_HOME / FLOWOPT_*) in headless Chromium, check it, save screenshots",
        description="Starts dagster-webserver, visits the sensors, runs, training_history, the gate checks and the lineage "
        "with Playwright and the system's Chromium, prints what it found and saves ui-*.png. Needs the ui extra and a "
        "Chromium binary. Exit code 1: something a user must find is missing; 2: no browser or webserver.",
    )
    ui.add_argument("--state", default=".demo", help="the demo's state directory (default .demo)")
    ui.add_argument("--out", default="docs/images", help="directory for the screenshots (default docs/images)")
    ui.set_defaults(fn=_ui_tour)
    real = sub.add_parser("demo-real", help="train SmolLM2-135M-Instruct as a tool-using agent (needs the smollm2 extra)")
    real.add_argument("--rounds", type=int, default=2, help="training rounds (default 2)")
    real.add_argument("--final-tasks", type=int, default=None, help="held-out tasks of the final comparison (default: all)")
    real.set_defaults(fn=_demo_real)
    bfcl = sub.add_parser("demo-bfcl", help="train SmolLM2-135M-Instruct on BFCL v4, scored by BFCL's own checker (needs the smollm2 and bfcl extras)")
    bfcl.add_argument("--rounds", type=int, default=2, help="GRPO rounds after the warm start (default 2)")
    bfcl.add_argument("--final-tasks", type=int, default=None, help="held-out tasks of the final comparison (default: all)")
    bfcl.add_argument("--modes", default="greedy,sampled", choices=["greedy,sampled", "greedy", "sampled"],
                      help="modes of the final comparison (default greedy,sampled; greedy alone halves its time)")
    bfcl.add_argument("--eval-dtype", default=None, choices=["bfloat16", "float32"],
                      help="precision the final comparison serves both policies in (default bfloat16 where the CPU computes it "
                           "natively, else float32; collection is float32)")
    bfcl.set_defaults(fn=_demo_bfcl)
    entry = sub.add_parser("bfcl-entry-point", help="score a policy on BFCL's held-out ids by flowopt and by BFCL's own CLI on the same gateway, and compare")
    entry.add_argument("--adapter", default=None, help="a LoRA adapter directory to score (default: v0, SmolLM2 as it is)")
    entry.add_argument("--tasks", type=int, default=None, help="a spread sample of this many held-out tasks (default: all)")
    entry.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="serving precision (default bfloat16)")
    entry.set_defaults(fn=_bfcl_entry_point)
    logs = sub.add_parser("demo-logs", help="train SmolLM2-135M-Instruct on real logs another model wrote, evaluated offline (needs the smollm2 extra)")
    logs.add_argument("--state", default=".demo-logs", help="the demo's own state directory (default .demo-logs)")
    logs.add_argument("--family", default="tau-bench", choices=["tau-bench", "fireact"],
                      help="which logs of ../shared/data: tau-bench's airline conversations (default) or FireAct's ReAct runs")
    logs.set_defaults(fn=_demo_logs)
    text = sub.add_parser(
        "demo-text",
        help="the word-problem agent trained from its own text log vs from the captured rollouts, on SmolLM2 (needs the smollm2 extra)",
    )
    text.add_argument("--state", default=".demo-text", help="the demo's own state directory (default .demo-text)")
    text.add_argument("--final-tasks", type=int, default=None, help="held-out tasks of the final comparison (default: all)")
    text.add_argument("--sampled-only", action="store_true", help="evaluate sampled only (no greedy pass)")
    text.add_argument("--resume", action="store_true", help="keep the collection and both candidates of an earlier run in --state; evaluate only")
    text.set_defaults(fn=_demo_text)
    prompt = sub.add_parser(
        "demo-prompt",
        help="a prompt-policy round for the word-problem agent on SmolLM2 behind the proxy (needs the smollm2 extra)",
    )
    prompt.add_argument("--state", default=".demo-prompt", help="the demo's own state directory (default .demo-prompt; cleared)")
    prompt.add_argument("--start-examples", type=int, default=1, help="hand-written worked examples in the weak prompt v0 (0-2, default 1)")
    prompt.add_argument("--collect-tasks", type=int, default=64, help="train tasks v0's flows are collected on (4 agents each; default 64)")
    prompt.add_argument("--search-tasks", type=int, default=32, help="train tasks every candidate is scored on (default 32)")
    prompt.add_argument("--candidates", type=int, default=4, help="candidates besides v0 (default 4)")
    prompt.add_argument("--k", type=int, default=3, help="demonstrations drawn per candidate (default 3)")
    prompt.add_argument("--final-tasks", type=int, default=None, help="held-out tasks of the gate (default: all)")
    prompt.add_argument("--greedy", action="store_true", help="evaluate greedy too at the gate (416 more episodes; runs the round in process)")
    prompt.add_argument("--in-process", action="store_true",
                        help="run the round in this process (the same functions) instead of as prompt_round_job under dagster-daemon")
    prompt.add_argument("--no-live-ab", action="store_true", help="promote a winner that passes the gate at once (no live A/B under the daemon)")
    prompt.set_defaults(fn=_demo_prompt)
    ingest = sub.add_parser(
        "ingest",
        help="land log files, register each as a log batch and run exactly those through the data plane",
        description="Land the named log files (a directory: the log files under it), register each as a log batch "
        "and materialise exactly those batches. Prints one JSON row per file (trajectories, quarantined, groups, "
        "groups_with_signal, mean_outcome, mean_shaped_reward, hint) and a line on stderr for each file that "
        "needs attention.",
        epilog="exit codes: 0 every file gave at least one valid trajectory; 1 a file could not be read (its line "
        "says why); 2 argument error, nothing ingested; 3 every record of a file was quarantined; 4 a file's bytes "
        "were already ingested and nothing ran (--force runs them again). With several files the first of 1, 3, 4 "
        "that applies wins.",
    )
    ingest.add_argument("paths", nargs="+", help="log files or directories to ingest")
    ingest.add_argument("--source", default=None, help="source name (default: the file's folder name, or the named directory's)")
    ingest.add_argument("--format", default="auto", choices=["auto", *known_formats()], help="parser (default: detect; plug-ins included)")
    ingest.add_argument("--landing", default=None, help="landing directory (default: the landing setting, .landing)")
    ingest.add_argument("--lake", default=None, help="lake directory (default: the lake setting, .lake)")
    ingest.add_argument("--home", default=None, help="Dagster instance directory (default: the dagster_home setting, .dagster_home)")
    ingest.add_argument("--force", action="store_true", help="materialise a batch again even if its bytes were already ingested")
    ingest.add_argument("--replace", action="store_true", help="retire earlier batches landed under the same name with other bytes")
    ingest.add_argument("--verbose", action="store_true", help="Dagster's log and full error tracebacks on stderr")
    ingest.set_defaults(fn=_ingest)
    serve = sub.add_parser("serve", help="the policy gateway: an OpenAI-compatible server that records rollouts")
    serve.add_argument("--models", default=None, help=f"the policy's models directory (default: the models setting, {DEFAULT_MODELS})")
    serve.add_argument("--landing", default=None, help=f"landing directory rollouts land in (default: the landing setting, {DEFAULT_LANDING})")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    serve.add_argument("--base-model", default=None, help="base model directory (default <models>/base); with no registry yet, it is registered as champion v0")
    serve.add_argument("--preset", default=None, help="serve a prepared preset (e.g. smollm2-135m-instruct; prepared under <models>/presets on first use)")
    serve.add_argument("--max-tokens", type=int, default=SERVE_MAX_TOKENS, help=f"completion cap for calls that set none (default {SERVE_MAX_TOKENS})")
    serve.add_argument("--source", default="gateway", help="landing sub-directory of rollouts that name no batch")
    serve.add_argument("--batch-size", type=int, default=1024, help="rollouts per landed batch (default 1024)")
    serve.add_argument("--flush-seconds", type=float, default=300.0, help="a batch lands at the latest this long after its first rollout")
    serve.add_argument("--max-batch-total-tokens", type=int, default=None,
                       help="most token slots (rows x longest prompt and cap, padding included) of the running batch's cache; "
                            "default: what 2 GiB holds for the model")  # fmt: skip
    serve.add_argument("--rollout-timeout", type=float, default=600.0, help="an idle, unfinished rollout lands unlabelled (for the judge) after this many seconds")
    serve.add_argument("--tokens-file", default=None, help="bearer tokens, one a line, besides $FLOWOPT_GATEWAY_TOKENS (comma-separated); "
                       "required to bind beyond loopback")  # fmt: skip
    serve.add_argument("--max-body-mb", type=float, default=8.0, help="largest request body, MiB (default 8; larger: 413)")
    serve.add_argument("--body-timeout", type=float, default=60.0, help="seconds to receive a request's body (default 60; slower: 408)")
    serve.add_argument("--upstream", default=None, metavar="URL",
                       help="proxy mode: forward every chat call to this OpenAI-compatible API root (e.g. http://127.0.0.1:8080/v1) "
                            "and capture its answers as text; no model is loaded here")  # fmt: skip
    serve.add_argument("--upstream-model", default=None, help="with --upstream: the model name sent upstream (default: the name the agent asks for)")
    serve.add_argument("--upstream-timeout", type=float, default=600.0, help="with --upstream: seconds per upstream call (default 600)")
    serve.set_defaults(fn=_serve)
    models = sub.add_parser("models", help="pretrained model presets shipped in pip packages")
    models_sub = models.add_subparsers(dest="models_command", required=True)
    prepare = models_sub.add_parser("prepare", help="convert a preset once into a Hugging Face directory")
    prepare.add_argument("preset", help="preset name (see: flowopt models list)")
    prepare.add_argument("--dir", default=None, help="target directory (default .models/presets/<preset>)")
    prepare.add_argument("--force", action="store_true", help="convert again even if already prepared")
    prepare.set_defaults(fn=_models_prepare)
    listing = models_sub.add_parser("list", help="the presets, whether installed and prepared")
    listing.set_defaults(fn=_models_list)
    promote = sub.add_parser("promote", help="end a live A/B by hand: the challenger becomes the champion")
    promote.add_argument("--models", default=None, help=f"models directory holding registry.json (default: the models setting, {DEFAULT_MODELS})")
    promote.add_argument("--home", default=None, help="DAGSTER_HOME whose champion asset records it (default: the dagster_home setting where set)")
    promote.add_argument("--reason", default="manual promotion", help="recorded in the registry history")
    promote.add_argument("--by", default=None, help="who promotes (default: the current user)")
    promote.set_defaults(fn=_promote)
    rollback = sub.add_parser(
        "rollback", help="restore the previous champion adapter in the registry (during a live A/B: withdraw the challenger)"
    )
    rollback.add_argument("--models", default=None, help=f"models directory holding registry.json (default: the models setting, {DEFAULT_MODELS})")
    rollback.add_argument("--home", default=None, help="DAGSTER_HOME whose champion asset records the rollback (default: the dagster_home setting where set)")
    rollback.add_argument("--reason", default="manual rollback", help="recorded in the registry history")
    rollback.add_argument("--by", default=None, help="who rolls back (default: the current user)")
    rollback.set_defaults(fn=_rollback)
    registry = sub.add_parser("registry", help="the adapter registry (champion and history)")
    registry_sub = registry.add_subparsers(dest="registry_command", required=True)
    rebuild = registry_sub.add_parser("rebuild", help="rebuild a damaged registry.json from its history event files")
    rebuild.add_argument("--models", default=None, help=f"models directory holding registry.json (default: the models setting, {DEFAULT_MODELS})")
    rebuild.set_defaults(fn=_registry_rebuild)
    show_registry = registry_sub.add_parser("show", help="champion, challenger, candidate and the number of events (exit 1: registry.json damaged)")
    show_registry.add_argument("--models", default=None, help=f"models directory holding registry.json (default: the models setting, {DEFAULT_MODELS})")
    show_registry.set_defaults(fn=_registry_show)
    bus = sub.add_parser("bus", help="the RabbitMQ message-bus source: tasks, responses and rewards landed as log batches")
    bus_sub = bus.add_subparsers(dest="bus_command", required=True)
    bus_help = {
        "consume": "read copies of the messages from flowopt's tap queues and land joined records (runs until SIGTERM)",
        "publish": "publish messages from a JSONL file to the exchanges, as agents do",
        "declare": "declare the exchanges tasks / responses / rewards and flowopt's tap queues bound to them (before agents publish)",
    }
    for name in ("consume", "publish", "declare"):
        cmd = bus_sub.add_parser(name, help=bus_help[name])
        cmd.add_argument("--url", default=None, help="AMQP URL (default $FLOWOPT_AMQP_URL, else amqp://guest:guest@127.0.0.1:5672/%%2F)")
        cmd.add_argument("--queue-prefix", default="", help="prefix of the exchange names tasks / responses / rewards and of the tap queues")
        cmd.add_argument("--tap", default="flowopt", help="flowopt's tap queues are <prefix><tap>.tasks / .responses / .rewards (default flowopt)")
        cmd.add_argument("--exchange-type", dest="exchange_type", choices=("fanout", "topic"), default="fanout",
                         help="type of the exchanges; topic taps bind with # (default fanout)")  # fmt: skip
        if name == "declare":
            cmd.set_defaults(fn=_bus_declare)
            continue
        if name == "publish":
            cmd.add_argument("file", help='JSONL, one {"queue": "tasks|responses|rewards", "message_id": ..., "body": {...}} per line')
            cmd.set_defaults(fn=_bus_publish)
            continue
        cmd.add_argument("--landing", default=None, help="landing directory (default $FLOWOPT_LANDING, else .landing); batches go to its bus/")
        cmd.add_argument("--max-records", dest="max_records", type=int, default=1000, help="records per batch file (default 1000)")
        cmd.add_argument("--window-seconds", dest="window_s", type=float, default=60.0, help="land a smaller batch this long after its first record (default 60)")
        cmd.add_argument("--unlabelled-timeout", dest="unlabelled_timeout_s", type=float, default=600.0,
                         help="seconds a response waits for its reward before it is landed unlabelled (default 600)")  # fmt: skip
        cmd.add_argument("--task-ttl", dest="task_ttl_s", type=float, default=3600.0, help="seconds a task is kept for later responses (default 3600)")
        cmd.add_argument("--prefetch", type=int, default=10_000, help="most unacknowledged messages at once (default 10000)")
        cmd.add_argument("--idle-exit", dest="idle_exit_s", type=float, default=None, help="exit after this many idle seconds (default: never)")
        cmd.add_argument("--max-message-bytes", dest="max_message_bytes", type=int, default=8 * 1024 * 1024,
                         help="a larger message is quarantined unparsed (default 8 MiB)")  # fmt: skip
        cmd.add_argument("--max-depth", dest="max_depth", type=int, default=64, help="a message nested deeper is quarantined (default 64 levels)")
        cmd.set_defaults(fn=_bus_consume)
    api = sub.add_parser(
        "api",
        help="the JSON-RPC 2.0 training API (training.start_grpo, get_status, list_jobs, cancel) on Dagster runs",
        description="Serves POST /rpc (bearer tokens from FLOWOPT_API_TOKENS), GET /metrics (Prometheus) and GET /health. "
        "Jobs are runs of training_round_job (and adapter_evaluation_job) submitted through the Dagster webserver's GraphQL API and read from the instance.",
    )
    api.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    api.add_argument("--port", type=int, default=8100, help="port (default 8100)")
    api.add_argument("--dagster-url", default=None, help=f"the Dagster webserver (default $FLOWOPT_DAGSTER_URL, else {DEFAULT_DAGSTER_URL})")
    api.add_argument("--home", default=None, help="DAGSTER_HOME of the instance (default $DAGSTER_HOME)")
    api.add_argument("--max-body-mb", type=float, default=4.0, help="largest request body, MiB (default 4; larger: 413), as flowopt serve's")
    api.add_argument("--body-timeout", dest="body_timeout_s", type=float, default=30.0, help="seconds to receive a request body; slower is HTTP 408 (default 30)")
    api.add_argument("--max-batch", type=int, default=100, help="most calls in one JSON-RPC batch; more is refused whole, -32600 (default 100)")
    api.set_defaults(fn=_api)
    proposals = sub.add_parser(
        "proposals",
        help="review the workflow changes workflow_proposals proposed: list, show, approve, reject, verify",
        description="Proposals are JSON Patches against an agent's workflow definition, with their evidence (docs/workflows.md). "
        "approve applies one as a new version of the definition (the previous one is kept); every decision goes to the "
        "append-only audit log <workflows>/audit.jsonl. Exit codes: 1 refused (the reason on stderr), 2 no such proposal.",
    )
    proposals_sub = proposals.add_subparsers(dest="proposals_command", required=True)
    workflows_help = "workflow directory (default: the workflows setting, $FLOWOPT_WORKFLOWS or .flowopt.toml, else .workflows)"
    proposals_list = proposals_sub.add_parser("list", help="the proposals, oldest first")
    proposals_list.add_argument("--status", default="open", choices=["open", "applied", "rejected", "stale", "superseded", "all"],
                         help="show only proposals with this status (default open)")  # fmt: skip
    proposals_list.add_argument("--agent", default=None, help="only this agent's proposals")
    proposals_list.add_argument("--json", action="store_true", help="JSON (without the evidence) instead of text")
    show = proposals_sub.add_parser("show", help="one proposal: patch, evidence, status, and whether it applies now")
    approve = proposals_sub.add_parser("approve", help="apply a proposal's patch as a new workflow version")
    approve.add_argument("--reason", default=None, help="why (recorded in the audit log)")
    reject = proposals_sub.add_parser("reject", help="reject a proposal (the workflow is untouched)")
    reject.add_argument("--reason", required=True, help="why (recorded in the audit log)")
    for cmd in (show, approve, reject):
        cmd.add_argument("id", help="proposal id (wp-...), from flowopt proposals list")
    for cmd in (approve, reject):
        cmd.add_argument("--by", default=None, help="who decides (default: the current user)")
    verify = proposals_sub.add_parser(
        "verify", help="check the audit log: hash chain, head, and every decision against its proposal file (exit 1: the first bad line first)"
    )
    for cmd in (proposals_list, show, approve, reject, verify):
        cmd.add_argument("--workflows", default=None, help=workflows_help)
        cmd.set_defaults(fn=_proposals)
    daemon = sub.add_parser(
        "daemon", help="dagster-daemon with its sensor loop every FLOWOPT_SENSOR_LOOP_SECONDS (Dagster's is fixed at 5 s), "
        "its sensor loop and run queue woken when a run finishes or is queued (FLOWOPT_RUN_WATCH_SECONDS); "
        "takes dagster-daemon's arguments, e.g. `flowopt daemon run -w workspace.yaml`",
    )  # fmt: skip
    daemon.add_argument("daemon_args", nargs=argparse.REMAINDER, help="dagster-daemon's arguments")
    daemon.set_defaults(fn=_daemon)
    schema = sub.add_parser("schema", help="print the JSON Schema of one canonical log line")
    schema.set_defaults(fn=_schema)
    return parser


if __name__ == "__main__":
    sys.exit(main())
