"""The ``flowopt`` command: ``demo``, ``demo-real``, ``ingest PATH...``, ``serve``, ``models``,
``rollback``, ``schema``."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from flow_assets.local import execute_requests, local_instance, tick_sensor
from flow_assets.logs.reader import FORMATS
from flow_assets.summary import batch_summary
from resources.lake import TrajectoryLake
from sensors.landing import LandedFile, batch_key, sha256_file


def _ingest(args: argparse.Namespace) -> int:
    from flow_assets.definitions import build_definitions

    landing, lake_root = Path(args.landing), Path(args.lake)
    instance = local_instance(args.home)
    keys_by_file: dict[str, str] = {}
    formats: dict[str, str] = {}
    for name in args.paths:
        src = Path(name)
        if not src.is_file():
            print(f"flowopt ingest: {src}: no such file", file=sys.stderr)
            return 2
        source = args.source or src.resolve().parent.name
        dest = landing / source / src.name
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(dest.name + ".tmp")
        shutil.copyfile(src, tmp)
        tmp.rename(dest)  # the landing convention: never expose a half-written file
        rel = dest.relative_to(landing).as_posix()
        if args.format != "auto":
            formats[rel] = args.format
        stat = dest.stat()
        keys_by_file[str(src)] = batch_key(LandedFile(dest, rel, source, stat.st_size, stat.st_mtime_ns), sha256_file(dest))
    defs = build_definitions(str(lake_root), str(landing), formats)
    tick = execute_requests(defs, instance, "log_batch_job", tick_sensor(defs, instance, "new_logs_sensor"))
    summary = {r["batch"]: r for r in batch_summary(TrajectoryLake(root=str(lake_root))).to_dicts()}
    files = []
    for path, key in keys_by_file.items():
        row = {"file": path, "partition_key": key, **{k: v for k, v in summary.get(key, {}).items() if k not in ("batch", "file")}}
        if key in tick.failed:
            row["error"] = tick.failed[key]
        files.append(row)
    print(json.dumps({"dagster_home": str(instance.root_directory), "files": files}, indent=2))
    return 1 if tick.failed else 0


def _demo(args: argparse.Namespace) -> int:
    from flow_assets.demo import run_demo

    run_demo()
    return 0


def _demo_real(args: argparse.Namespace) -> int:
    from flow_assets.demo_real import run_real_demo
    from flow_assets.policy.presets import PresetUnavailable

    try:
        run_real_demo(rounds=args.rounds, final_tasks=args.final_tasks)
    except PresetUnavailable as exc:
        print(f"flowopt demo-real: {exc}", file=sys.stderr)
        return 2
    return 0


def _serve(args: argparse.Namespace) -> int:
    from flow_assets.gateway.app import GatewayConfig
    from flow_assets.gateway.server import serve_forever
    from flow_assets.policy.store import PolicyStore

    store = PolicyStore(models_root=args.models, base_model_path=args.base_model, max_new_tokens=args.max_tokens)
    if not store.base_path.is_dir():
        print(f"flowopt serve: no base model at {store.base_path} (run `make demo`, or pass --base-model)", file=sys.stderr)
        return 2
    if not store.registry_path.exists():
        print(f"flowopt serve: no registry at {store.registry_path}: materialise base_policy first", file=sys.stderr)
        return 2
    config = GatewayConfig(
        default_max_tokens=args.max_tokens,
        batch_max_trajectories=args.batch_size,
        batch_flush_seconds=args.flush_seconds,
        rollout_timeout_s=args.rollout_timeout,
        source=args.source,
    )
    gateway = store.make_gateway(args.landing, config=config)
    print(
        f"flowopt gateway: http://{args.host}:{args.port}/v1 serving {', '.join(gateway.resolver.names())}; "
        f"rollouts land in {Path(args.landing) / args.source}",
        flush=True,
    )
    serve_forever(gateway, args.host, args.port)
    return 0


def preset_dir(name: str, models: str | Path = ".models") -> Path:
    """Where ``flowopt models prepare NAME`` puts a preset by default: ``<models>/presets/<name>``."""
    return Path(models) / "presets" / name


def _models_prepare(args: argparse.Namespace) -> int:
    from flow_assets.policy.presets import PresetUnavailable, prepare_model

    target = Path(args.dir) if args.dir else preset_dir(args.preset)
    try:
        prepared = prepare_model(args.preset, target, force=args.force)
    except (KeyError, PresetUnavailable) as exc:
        print(f"flowopt models prepare: {exc.args[0]}", file=sys.stderr)
        return 2
    print(json.dumps({**vars(prepared), "use": f"FLOWOPT_BASE_MODEL={prepared.path}"}, indent=2))
    return 0


def _models_list(args: argparse.Namespace) -> int:
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


def _rollback(args: argparse.Namespace) -> int:
    from resources.registry import AdapterRegistry, RegistryError

    registry = AdapterRegistry(root=args.models)
    try:
        before = registry.champion()
        after = registry.rollback(by=args.by, reason=args.reason)
    except RegistryError as exc:
        print(f"flowopt rollback: {exc}", file=sys.stderr)
        return 1
    print(json.dumps({"previous_champion": before["version"], "champion": after["version"], "adapter_path": after["adapter_path"]}))
    return 0


def _schema(args: argparse.Namespace) -> int:
    from flow_assets.logs.schema import json_schema

    print(json.dumps(json_schema(), indent=2, ensure_ascii=False))
    return 0


def _quiet_libraries() -> None:
    # the tiny model is loaded many times per round; progress bars and deprecation notes drown
    # the lines a person reads
    import warnings

    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module="dagster")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``flowopt`` console script; returns the process exit code."""
    _quiet_libraries()
    parser = argparse.ArgumentParser(prog="flowopt", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the main job end to end on the real logs (local instance)")
    demo.set_defaults(fn=_demo)
    real = sub.add_parser("demo-real", help="train SmolLM2-135M-Instruct as a tool-using agent (needs the smollm2 extra)")
    real.add_argument("--rounds", type=int, default=2, help="training rounds (default 2)")
    real.add_argument("--final-tasks", type=int, default=None, help="held-out tasks of the final comparison (default: all)")
    real.set_defaults(fn=_demo_real)
    ingest = sub.add_parser("ingest", help="land log files, register their partitions and materialise them")
    ingest.add_argument("paths", nargs="+", help="log files to ingest")
    ingest.add_argument("--source", default=None, help="source name (default: the file's folder name)")
    ingest.add_argument("--format", default="auto", choices=["auto", *sorted(FORMATS)], help="parser (default: detect)")
    ingest.add_argument("--landing", default=".landing", help="landing directory (default .landing)")
    ingest.add_argument("--lake", default=".lake", help="lake directory (default .lake)")
    ingest.add_argument("--home", default=None, help="DAGSTER_HOME (default $DAGSTER_HOME or .dagster_home)")
    ingest.set_defaults(fn=_ingest)
    serve = sub.add_parser("serve", help="the policy gateway: an OpenAI-compatible server that records rollouts")
    serve.add_argument("--models", default=".models", help="the policy's models directory (default .models)")
    serve.add_argument("--landing", default=".landing", help="landing directory rollouts land in (default .landing)")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    serve.add_argument("--base-model", default=None, help="base model directory (default <models>/base)")
    serve.add_argument("--max-tokens", type=int, default=256, help="completion cap for calls that set none (default 256)")
    serve.add_argument("--source", default="gateway", help="landing sub-directory of rollouts that name no batch")
    serve.add_argument("--batch-size", type=int, default=1024, help="rollouts per landed batch (default 1024)")
    serve.add_argument("--flush-seconds", type=float, default=300.0, help="a batch lands at the latest this long after its first rollout")
    serve.add_argument("--rollout-timeout", type=float, default=600.0, help="an idle, unfinished rollout lands as an error after this many seconds")
    serve.set_defaults(fn=_serve)
    models = sub.add_parser("models", help="pretrained model presets shipped in pip packages")
    models_sub = models.add_subparsers(dest="models_command", required=True)
    prepare = models_sub.add_parser("prepare", help="convert a preset once into a Hugging Face directory")
    prepare.add_argument("preset", help="preset name (see `flowopt models list`)")
    prepare.add_argument("--dir", default=None, help="target directory (default .models/presets/<preset>)")
    prepare.add_argument("--force", action="store_true", help="convert again even if already prepared")
    prepare.set_defaults(fn=_models_prepare)
    listing = models_sub.add_parser("list", help="the presets, whether installed and prepared")
    listing.set_defaults(fn=_models_list)
    rollback = sub.add_parser("rollback", help="restore the previous champion adapter in the registry")
    rollback.add_argument("--models", default=".models", help="models directory holding registry.json (default .models)")
    rollback.add_argument("--reason", default="manual rollback", help="recorded in the registry history")
    rollback.add_argument("--by", default=None, help="who rolls back (default: the current user)")
    rollback.set_defaults(fn=_rollback)
    schema = sub.add_parser("schema", help="print the JSON Schema of one canonical log line")
    schema.set_defaults(fn=_schema)
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
