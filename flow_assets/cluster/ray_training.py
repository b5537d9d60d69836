"""A GRPO round's update, data-parallel over the workers of a Ray cluster (#31, items 1-3).

Ray Train's ``TorchTrainer`` starts the workers (one process each, placed by Ray on any node of
the cluster), sets up their ``torch.distributed`` process group (gloo on CPUs, NCCL on GPUs) and
restarts the whole group when a worker dies; flowopt's trainer does the rest, unchanged::

    driver (a Dagster run, a script)     train_data_parallel(store, adapter, samples, config, workers=M)
      -> TorchTrainer, M workers         each: store.load(adapter, trainable=True)
                                               train_grpo_round(..., resume=True,
                                                   data_parallel=DataParallel(rank, M, all_reduce SUM))
      -> rank 0 writes                   config.output_dir/checkpoint-<step>/ (every save_steps),
                                         <out_dir>/adapter/ and <out_dir>/round_result.json

Every worker holds all the samples and computes the same minibatches; each takes its share of a
minibatch's micro-batches and the gradients are summed over the workers before the optimizer
step (:mod:`flow_assets.policy.trainer`, "Data parallel"), so M workers give the one-process
update up to the order of float additions (tests/cluster/test_ray_training.py measures it).

**Faults**: a worker that dies (SIGKILL, out of memory, its node lost) fails the group; Ray Train
starts a new group (up to ``max_failures`` times) and every new worker resumes from the latest
complete checkpoint in ``config.output_dir`` (checkpoints are written atomically by rank 0, so a
kill mid-write leaves none half-written), exactly as a single-process round resumes after a kill.
The output directory must be one every worker can reach (one machine, or a shared filesystem).

**The driver is a process of its own** (:func:`run_driver`): ``ray.init`` sets environment
variables of the process that calls it (``RAY_AUTH_MODE``, ``RAY_USAGE_STATS_ENABLED``,
``PYTHONBREAKPOINT`` with Ray 2.60), and a Dagster run has threads that may read ``os.environ``
at any moment, so a run never connects to Ray itself: it writes the round's inputs to a file,
starts ``python -m flow_assets.cluster.ray_training <spec>``, and reads the result back. A
Dagster asset starts it through Dagster Pipes (``PipesSubprocessClient``): rank 0 appends each
step's metrics to ``<out_dir>/progress.jsonl`` (shared storage, as the checkpoints), and the
driver forwards every line to the run as it comes, as a Pipes log line and a custom message.

No Dagster here; the Ray import happens inside the call (the ``ray`` extra).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from flow_assets.policy.configs import GRPOTrainerConfig, TrainingSample
from flow_assets.policy.store import PolicyStore

#: what rank 0 writes next to the adapter: the round's :class:`~flow_assets.policy.trainer.RoundResult` as JSON
RESULT_FILE = "round_result.json"
#: rank 0's step metrics, one JSON object a line, appended as each step ends (the driver forwards them)
PROGRESS_FILE = "progress.jsonl"


def _worker(config: dict) -> None:
    """One Ray Train worker: load the adapter, train this rank's share, rank 0 saves the result."""
    import ray.train
    import torch.distributed as dist

    from flow_assets.policy.lora import save_lora_adapter
    from flow_assets.policy.trainer import DataParallel, train_grpo_round

    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    model, _ = config["store"].load(config["adapter"], trainable=True)
    parallel = DataParallel(rank, world, lambda t: dist.all_reduce(t, op=dist.ReduceOp.SUM))
    on_step, progress = config["on_step"], Path(config["out_dir"]) / PROGRESS_FILE

    def hook(metrics) -> None:
        if rank == 0:
            with progress.open("a") as f:
                f.write(json.dumps(dataclasses.asdict(metrics)) + "\n")
        if on_step is not None:
            on_step(rank, metrics)

    result = train_grpo_round(model, config["samples"], config["trainer"], resume=True, on_step=hook, data_parallel=parallel)
    if rank == 0:
        out = Path(config["out_dir"])
        save_lora_adapter(model, out / "adapter")
        (out / RESULT_FILE).write_text(json.dumps(dataclasses.asdict(result)))


def connect(address: str | None = None) -> None:
    """Connect this process to the Ray cluster at ``address`` (``ray://`` or ``host:port``; ``None``
    or empty: ``RAY_ADDRESS`` as Ray reads it, else a new local cluster), once; a process already
    connected stays so. Sets environment variables of this process (module docstring): call it
    only in a process of its own, such as :func:`run_driver`'s.

    Raises:
        ConnectionError: no cluster answers at ``address``.
    """
    import ray

    if not ray.is_initialized():
        ray.init(address=address or None, include_dashboard=False, log_to_driver=False)


def train_data_parallel(
    store: PolicyStore,
    adapter_path: str,
    samples: list[TrainingSample],
    config: GRPOTrainerConfig,
    workers: int,
    out_dir: str | Path,
    max_failures: int = 1,
    use_gpu: bool = False,
    on_step: Callable[[int, object], None] | None = None,
):
    """Train one round's candidate adapter from ``adapter_path`` on ``samples`` with ``workers``
    data-parallel Ray Train workers (module docstring), on the Ray cluster this process is
    connected to (:func:`connect` first; a local one is started if none is).

    Args:
        store: where the base model is (each worker loads it, so its paths must be readable on
            every node).
        config: the round's trainer settings; ``config.output_dir`` holds the checkpoints.
        workers: data-parallel workers, each given one CPU (or one GPU with ``use_gpu``).
        out_dir: where rank 0 writes ``adapter/`` and :data:`RESULT_FILE`.
        max_failures: worker-group restarts Ray Train may do after a worker dies; each new group
            resumes from the latest checkpoint.
        on_step: called on every worker after each of its steps as ``on_step(rank, metrics)``
            (it is pickled to the workers; e.g. a progress report or a fault injected by a test).

    Returns:
        ``(result, adapter_dir)``: rank 0's :class:`~flow_assets.policy.trainer.RoundResult` and
        the trained adapter's directory.

    Raises:
        ray.train.TrainingFailedError: the round still failed after ``max_failures`` restarts
            (the error names the worker's own exception).
        ValueError: ``workers`` < 1.

    Connects this process to Ray (:func:`connect`): call it in the driver process
    :func:`run_driver` starts, or in a script of its own.
    """
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    connect()
    trainer = TorchTrainer(
        _worker,
        train_loop_config={"store": store, "adapter": str(adapter_path), "samples": samples, "trainer": config, "out_dir": str(out),
                           "on_step": on_step},  # fmt: skip
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=use_gpu),
        run_config=RunConfig(name="flowopt-round", storage_path=str(out / "ray"), failure_config=FailureConfig(max_failures=max_failures)),
    )
    trainer.fit()
    return _result(out)


def _result(out: Path):
    """Rank 0's :class:`~flow_assets.policy.trainer.RoundResult` and adapter directory under ``out``."""
    from flow_assets.policy.trainer import RoundResult, StepMetrics

    raw = json.loads((out / RESULT_FILE).read_text())
    raw["steps"] = [StepMetrics(**m) for m in raw["steps"]]
    return RoundResult(**raw), out / "adapter"


#: the driver's input, written by :func:`run_driver` (cloudpickle: ``on_step`` may be a closure)
SPEC_FILE = "ray_round_spec.pkl"


def run_driver(store: PolicyStore, adapter_path: str, samples: list[TrainingSample], config: GRPOTrainerConfig, workers: int,
               out_dir: str | Path, address: str | None = None, max_failures: int = 1,
               on_step: Callable[[int, object], None] | None = None, launch: Callable[[list[str]], None] | None = None):  # fmt: skip
    """:func:`train_data_parallel` in a driver process of its own (module docstring), connected
    to the Ray cluster at ``address`` (``None``: a local cluster it starts and stops).

    Args:
        launch: runs the driver's command line and returns when it ended, raising if it failed;
            default: a plain subprocess (:func:`run_subprocess`); a Dagster asset passes one that
            runs it with Dagster Pipes and ``--pipes`` added (the driver then reports each step).

    Returns:
        As :func:`train_data_parallel`.

    Raises:
        RuntimeError: the driver failed (from the default ``launch``: with the end of its output,
            the workers' error included), or it ended without a result.
    """
    from ray import cloudpickle

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stale in (RESULT_FILE, PROGRESS_FILE):
        (out / stale).unlink(missing_ok=True)
    spec = out / SPEC_FILE
    spec.write_bytes(cloudpickle.dumps({"store": store, "adapter_path": str(adapter_path), "samples": samples, "config": config,
                                        "workers": workers, "out_dir": str(out), "address": address, "max_failures": max_failures,
                                        "on_step": on_step}))  # fmt: skip
    (launch or run_subprocess)([sys.executable, "-m", "flow_assets.cluster.ray_training", str(spec)])
    if not (out / RESULT_FILE).exists():
        raise RuntimeError(f"the Ray round's driver ended without writing {out / RESULT_FILE}")
    return _result(out)


def run_subprocess(command: list[str]) -> None:
    """Run ``command`` to its end (output captured).

    Raises:
        RuntimeError: a non-zero exit; the message holds the end of its output.
    """
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the Ray round's driver failed (exit {done.returncode}):\n{(done.stdout + done.stderr)[-4000:]}")


class _Forwarder(threading.Thread):
    """The driver's thread that reads rank 0's progress lines as they are appended and hands each
    one (a dict) to ``emit``; :meth:`finish` reads what is left and stops."""

    def __init__(self, path: Path, emit: Callable[[dict], None], poll_s: float = 0.2):
        super().__init__(daemon=True, name="flowopt-ray-progress")
        self.path, self.emit, self.poll_s = path, emit, poll_s
        self.done, self.offset = threading.Event(), 0

    def _read(self) -> None:
        if not self.path.exists():
            return
        with self.path.open() as f:
            f.seek(self.offset)
            while (line := f.readline()).endswith("\n"):
                self.offset = f.tell()
                self.emit(json.loads(line))

    def run(self) -> None:
        while not self.done.wait(self.poll_s):
            self._read()

    def finish(self) -> None:
        self.done.set()
        self.join()
        self._read()


def _main(spec_path: str, pipes: bool) -> None:
    """The driver process: read the spec, connect, train (rank 0 writes the result); with
    ``pipes`` (``--pipes``: started by Dagster Pipes), each step's metrics go to the run as rank 0
    reports them."""
    from dagster_pipes import open_dagster_pipes
    from ray import cloudpickle

    spec = cloudpickle.loads(Path(spec_path).read_bytes())
    connect(spec.pop("address"))
    args = [spec.pop(k) for k in ("store", "adapter_path", "samples", "config", "workers", "out_dir")]
    if not pipes:
        train_data_parallel(*args, **spec)
        return
    with open_dagster_pipes() as pipes:
        total = args[3].max_steps

        def emit(m: dict) -> None:
            pipes.log.info(f"ray rank 0: step {m['step']}{f'/{total}' if total else ''}: loss {m['loss']:.4f}, "
                           f"grad norm {m['grad_norm']:.3f}, clip fraction {m['clip_fraction']:.3f}, {m['num_samples']} samples")  # fmt: skip
            pipes.report_custom_message(m)

        forwarder = _Forwarder(Path(args[5]) / PROGRESS_FILE, emit)
        forwarder.start()
        try:
            train_data_parallel(*args, **spec)
        finally:
            forwarder.finish()


if __name__ == "__main__":
    _main(sys.argv[1], "--pipes" in sys.argv[2:])
