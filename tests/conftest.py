"""Shared fixtures: the real agent logs beside the repo, and a real Dagster instance."""

import contextlib
import os
import uuid
from pathlib import Path

import pytest
from dagster import instance_for_test

pytest_plugins = ["tests.ci_strict"]  # in CI a skip fails (GPU tests excepted)


def pytest_configure(config):
    """Under pytest-xdist (one worker per core), each worker's torch computes on one thread: two
    workers with a thread per core each oversubscribe the cores, and torch's spinning threads then
    made the calculator policy's 15-second warm start take 135-141 s (2026-11-27). Set here, at
    the worker's start-up, before any test (or thread) runs."""
    if hasattr(config, "workerinput"):
        import torch

        torch.set_num_threads(1)

def pytest_collection_finish(session):
    """Once every test module is imported (torch, transformers, Dagster, polars and flowopt with
    them), collect once and freeze what is left from Python's garbage collector: a full
    collection walked all of it, 0.3-0.4 s each time with torch and transformers imported, 34
    times (14.1 of 124 s) in ``training/test_assets.py`` alone. Frozen objects are never walked
    again (the imports live as long as the process anyway); the tests' own objects are collected
    as before. The run workers do the same (``flow_assets/runtime/run_launcher.py``). Done at
    start-up, before any test (or thread of one) runs. The heavy libraries are imported first only
    in pytest-xdist's workers (``make test``): a run of one small file in one process would pay
    their import for nothing."""
    import gc
    import importlib

    if hasattr(session.config, "workerinput"):
        for name in FROZEN_IMPORTS:
            importlib.import_module(name)
    gc.collect()
    gc.freeze()


#: imported before the freeze: the libraries the tests load models and runs with (most test modules
#: import them only inside their tests and fixtures)
FROZEN_IMPORTS = ("torch", "transformers", "transformers.models.llama.modeling_llama", "peft", "dagster", "polars", "duckdb",
                  "flow_assets.definitions", "flow_assets.policy.store", "flow_assets.policy.trainer", "flow_assets.training.rounds",
                  "flow_assets.serving.gateway.serve", "flow_assets.serving.agents.harness", "reasoning_gym")  # fmt: skip


#: the slowest test files, slowest first (wall seconds summed over a file's tests and fixtures in
#: an idle `make test`, 2026-11-28: 185, 177, 129, 128, 113, 98, 91, 63, 35, 34, 33, 32)
SLOW_FILES = (
    "tests/test_benchmarks.py", "tests/cluster/test_ray_training.py", "tests/runtime/test_deployment.py",
    "tests/runtime/test_crash_recovery.py", "tests/api/test_api_deployment.py", "tests/training/test_assets.py",
    "tests/cluster/test_ray_rollouts.py", "tests/logs/test_ingest.py", "tests/serving/test_constrained.py",
    "tests/demo/test_demo_commands.py", "tests/policy/test_presets.py", "tests/policy/test_captured_samples.py",
)  # fmt: skip


def pytest_collection_modifyitems(config, items):
    """The slowest files first, the rest in their own order (a stable sort: the tests of a file
    keep theirs, which some files' module fixtures rely on). pytest-xdist's ``--dist loadfile``
    hands files to the workers in this order, so the long ones start early and the short ones fill
    in at the end (longest first); in collection order two of them had come last on one worker,
    which finished 100 s after the other (2026-11-28)."""
    rank = {name: i for i, name in enumerate(SLOW_FILES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))


#: files whose tests share a session fixture too costly to build twice at once: they run on one
#: xdist worker, one after the other. The Ray tests' cluster (``tests/cluster/conftest.py``) is a
#: head, its GCS, raylet and worker processes (49-74 s to start beside the other workers); on two
#: workers it was started twice, at the same time. Their tests stay slow beside two other workers
#: all the same (68-190 s each from a fresh clone, 2026-11-29; 38-102 s beside one)
SAME_WORKER = {"tests/cluster/test_ray_training.py": "tests/cluster", "tests/cluster/test_ray_rollouts.py": "tests/cluster"}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile`` with the files of :data:`SAME_WORKER` handed out as one unit (xdist's
    own hook for a custom scheduler; any other ``--dist`` keeps xdist's scheduler)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SharedFixtureFileScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)
            return SAME_WORKER.get(scope, scope)

    return SharedFixtureFileScheduling(config, log)


SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
TAU_BENCH = SHARED_DATA / "tau-bench" / "gpt-4o-airline.json"

# Tests land files complete (written, or renamed from .tmp) and tick the sensor at once; the
# settle time for files written in place has its own test, which sets it.
os.environ.setdefault("FLOWOPT_SETTLE_SECONDS", "0")
# A demo run in this repository leaves .flowopt.toml (its state's paths) here; the tests never read
# it, so none of them can point at, or write into, the demo's state. Tests of the file pass their own.
os.environ.setdefault("FLOWOPT_PROJECT_FILE", "none")


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """``../shared/data``: real agent logs nobody here wrote, used as they are."""
    assert SHARED_DATA.is_dir(), f"real logs expected at {SHARED_DATA}"
    return SHARED_DATA


@pytest.fixture
def dagster_instance(tmp_path):
    """A real (SQLite, on disk) Dagster instance in a temporary DAGSTER_HOME."""
    home = tmp_path / "dagster_home"
    home.mkdir()
    with instance_for_test(temp_dir=str(home)) as instance:
        yield instance


def make_policy_dir(root: Path, sft_steps: int = 0, seed: int = 0) -> Path:
    """A policy directory as ``base_policy`` leaves it: the tiny model, warm-started on
    ``sft_steps`` of calculator demonstrations (none: random answers), champion ``v0``."""
    from flow_assets.policy.sft import SFTConfig
    from flow_assets.policy.store import PolicyStore
    from flow_assets.policy.tiny_model import TinyModelConfig
    from flow_assets.training.rounds import build_base_policy
    from flow_assets.tasks.calculator import CalculatorSource
    from resources.registry import AdapterRegistry

    build_base_policy(
        PolicyStore(str(root)), AdapterRegistry(root=str(root)), CalculatorSource(), TinyModelConfig(seed=seed),
        SFTConfig(steps=sft_steps, seed=seed), 500 if sft_steps else 1, by="test",
    )  # fmt: skip
    return root


@pytest.fixture(scope="session")
def fresh_policy_dir(tmp_path_factory) -> Path:
    """A freshly initialised tiny policy (random answers), champion v0."""
    return make_policy_dir(tmp_path_factory.mktemp("fresh_policy"))


@pytest.fixture(scope="session")
def calculator_policy_dir(request, tmp_path_factory) -> Path:
    """A tiny policy warm-started on calculator conversations: it calls its tool, then answers.

    Under pytest-xdist it is trained once for the whole run (the first worker to ask builds it,
    under a file lock, in the run's shared temporary root) and each worker gets its own copy, so
    a test that writes into it never races another worker's."""
    import shutil

    from filelock import FileLock

    own = tmp_path_factory.mktemp("calculator_policy")
    if not hasattr(request.config, "workerinput"):
        return make_policy_dir(own, sft_steps=200)
    shared = tmp_path_factory.getbasetemp().parent / "calculator_policy_shared"
    with FileLock(str(shared) + ".lock"):
        if not (shared / ".built").exists():
            shutil.rmtree(shared, ignore_errors=True)
            make_policy_dir(shared, sft_steps=200)
            (shared / ".built").touch()
    shutil.copytree(shared, own, dirs_exist_ok=True, ignore=shutil.ignore_patterns(".built"))
    # the registry (and its history) name adapters by absolute path: the copy's own
    for path in [*own.rglob("*.json"), *own.rglob("*.jsonl")]:
        text = path.read_text()
        if str(shared) in text:
            path.write_text(text.replace(str(shared), str(own)))
    return own


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    """``flowopt <argv>`` in this process: ``(exit code, stdout, stderr)``. The same ``main`` the
    console script calls, without paying a new interpreter's imports (torch, Dagster) per call;
    tests that need the installed script itself run it as a subprocess."""
    import contextlib
    import io

    from flow_assets.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main([str(a) for a in argv])
        except SystemExit as exc:  # argparse refusing its arguments
            rc = exc.code if isinstance(exc.code, int) else 2
    return rc, out.getvalue(), err.getvalue()


PG_HOST, PG_PORT, PG_USER = os.environ.get("FLOWOPT_PG_HOST", "127.0.0.1"), 5432, os.environ.get("FLOWOPT_PG_USER", "postgres")


@contextlib.contextmanager
def postgres_database():
    """A database of its own on the PostgreSQL server at ``FLOWOPT_PG_HOST``:5432 (trust auth),
    dropped afterwards; yields its dagster-postgres ``postgres_db`` config. Skips the test with
    the reason where no server answers."""
    import psycopg2

    name = f"flowopt_test_{uuid.uuid4().hex[:10]}"
    try:
        admin = psycopg2.connect(host=PG_HOST, port=PG_PORT, user=PG_USER, dbname="postgres", connect_timeout=5)
    except psycopg2.OperationalError as exc:
        pytest.skip(f"no PostgreSQL server at {PG_HOST}:{PG_PORT}: {exc}")
    admin.autocommit = True
    with admin.cursor() as cur:
        cur.execute(f'create database "{name}"')
    try:
        # SQLAlchemy 2.1 maps plain postgresql:// to psycopg 3, whose server-side binding breaks
        # dagster-postgres' NOTIFY; the psycopg2 driver is named explicitly (as in dagster.yaml)
        yield {"hostname": PG_HOST, "port": PG_PORT, "username": PG_USER, "password": "", "db_name": name, "scheme": "postgresql+psycopg2"}
    finally:
        with admin.cursor() as cur:
            cur.execute(f'drop database if exists "{name}" with (force)')
        admin.close()
