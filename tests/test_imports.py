"""The code location loads without the ML stack and without the gateway's web stack.

Every run the Dagster daemon launches, every sensor evaluation and the code server import the code
location first; torch, transformers and the rest cost seconds there, paid per process. Each check
runs a fresh interpreter (a module an earlier test imported would hide an import), imports the
modules, and reports which heavy packages ended up in ``sys.modules`` and the flowopt lines that
first imported each.
"""

import json
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import resources

ROOT = Path(__file__).resolve().parents[1]

HEAVY = ("torch", "transformers", "peft", "trl", "reasoning_gym", "matplotlib", "tokenizers", "safetensors", "accelerate", "vllm", "openai",
         # the gateway's web stack and the upstream's HTTP client: 0.35 s of the code location's
         # 2.1 s load until the rounds imported them where they serve or call (2026-11-29)
         "fastapi", "starlette", "uvicorn", "sse_starlette", "prometheus_client", "httpx")  # fmt: skip

CODE_LOCATION = [
    "flow_assets.definitions",
    "sensors.new_logs",
    "sensors.training",
    "sensors.self_play",
    "sensors.ab_monitor",
    *(f"resources.{m.name}" for m in pkgutil.iter_modules(resources.__path__)),
]

_CHILD = r"""
import importlib, importlib.abc, json, sys, traceback

heavy, root, modules, resolve_jobs = json.loads(sys.argv[1])
importers = {}


class Watch(importlib.abc.MetaPathFinder):
    # the last lookup of a package before it loads is its import: a probe (polars asks for
    # torch with importlib.util.find_spec) looks it up without loading it
    def find_spec(self, name, path=None, target=None):
        if name in heavy and name not in sys.modules:
            importers[name] = [
                f"{f.filename[len(root) + 1:]}:{f.lineno}"
                for f in traceback.extract_stack()[:-1]
                if f.filename.startswith(root + "/") and "/.venv/" not in f.filename
            ]
        return None


sys.meta_path.insert(0, Watch())
for name in modules:
    importlib.import_module(name)
jobs = []
if resolve_jobs:
    from flow_assets.definitions import defs

    jobs.append(defs.resolve_job_def("training_round_job").name)
    jobs += [job.name for job in defs.resolve_all_job_defs()]
print(json.dumps({"heavy": {name: importers.get(name, []) for name in heavy if name in sys.modules}, "jobs": jobs}))
"""


def _fresh_import(modules: list[str], resolve_jobs: bool = False) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps([HEAVY, str(ROOT), modules, resolve_jobs])],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _describe(heavy: dict[str, list[str]]) -> str:
    return "; ".join(f"{name} (first imported at {' > '.join(chain) or 'no flowopt line'})" for name, chain in heavy.items())


def test_the_code_location_and_its_jobs_load_without_the_ml_stack():
    found = _fresh_import(CODE_LOCATION, resolve_jobs=True)
    assert not found["heavy"], f"loading the code location imports {_describe(found['heavy'])}"
    assert found["jobs"][0] == "training_round_job"
    assert {"log_batch_job", "base_policy_job", "collect_rollouts_job", "ab_test_job"} <= set(found["jobs"])


def test_the_check_names_a_heavy_import_and_its_importer():
    # a module that does import part of the stack: the check above cannot pass by seeing nothing
    found = _fresh_import(["flow_assets.policy.tokenizer"])["heavy"]
    assert {"tokenizers", "transformers"} <= set(found), found
    assert found["tokenizers"][-1].startswith("flow_assets/policy/tokenizer.py:"), found


_CLI_CHILD = r"""
import json, sys
from flow_assets.cli import main

rc = main(sys.argv[1:])
state = {"rc": rc, "transformers": "transformers" in sys.modules}
if state["transformers"]:
    from transformers.utils import logging as hf_logging

    state.update(verbosity=hf_logging.get_verbosity(), progress_bars=hf_logging.is_progress_bar_enabled())
print(json.dumps(state))
"""


def _cli(args: list[str], env: dict[str, str]) -> dict:
    proc = subprocess.run([sys.executable, "-c", _CLI_CHILD, *args], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_cli_command_imports_transformers_to_quiet_it_only_when_it_loads_models(tmp_path):
    env = {**os.environ, "FLOWOPT_MODELS": str(tmp_path)}
    assert _cli(["schema"], env) == {"rc": 0, "transformers": False}
    # `models` converts and loads checkpoints: transformers is quieted before any of that
    assert _cli(["models", "list"], env) == {"rc": 0, "transformers": True, "verbosity": 40, "progress_bars": False}
