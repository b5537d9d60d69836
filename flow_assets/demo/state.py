"""The demo's state: where it lives (``.demo/`` or where the settings point), the marker that lets the
demo clear only what it created, the real logs it lands first, and the sensor cursors it keeps."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from flow_assets.runtime.local import REPO_ROOT
from flow_assets.settings import Settings, write_demo_file


SHARED_DATA = REPO_ROOT.parent / "shared" / "data"
_INSTANCE_STORAGE = ("storage", "history", "schedules", "logs", ".logs_queue", ".telemetry")
_TRAINING_CURSOR = "flowopt/training_round_sensor"


def land_shared_data(data_dir: Path, landing: Path) -> list[Path]:
    """Copy every ``*.json`` log of ``data_dir`` into ``landing/<source>/...`` the way a writer
    must (write ``.tmp``, then rename); the source is the top folder (tau-bench, tau2-bench,
    fireact). Returns the landed paths.

    Raises:
        FileNotFoundError: ``data_dir`` does not exist (the message names it).
    """
    if not data_dir.is_dir():
        raise FileNotFoundError(f"real agent logs not found at {data_dir}")
    landed = []
    for src in sorted(data_dir.rglob("*.json")):
        dest = landing / src.relative_to(data_dir)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(dest.name + ".tmp")
        shutil.copyfile(src, tmp)
        tmp.rename(dest)
        landed.append(dest)
    return landed


#: the file that marks a directory as the demo's own state (safe to clear on the next run)
MARKER = ".flowopt-demo"
#: entries a directory may hold without counting as state: the marker, instance config and locks,
#: prepared model presets (inputs, not output)
_NOT_STATE = {MARKER, "dagster.yaml", ".flowopt-instance.lock", "presets"}


class DemoStateError(RuntimeError):
    """The demo would have to delete state it did not create (the message lists it)."""


@dataclass(frozen=True)
class DemoState:
    """Where the demo keeps its Dagster instance (``home``), lake, landing directory, models and
    workflow definitions: ``DAGSTER_HOME`` / ``FLOWOPT_LAKE`` / ``FLOWOPT_LANDING`` /
    ``FLOWOPT_MODELS`` / ``FLOWOPT_WORKFLOWS`` where set, else ``root/dagster_home``,
    ``root/lake``, ``root/landing``, ``root/models``, ``root/workflows`` (absolute paths).
    ``workflows`` ``None``: ``workflows`` beside ``models`` (a state built by hand)."""

    home: Path
    lake: Path
    landing: Path
    models: Path
    workflows: Path | None = None

    def __post_init__(self) -> None:
        if self.workflows is None:
            object.__setattr__(self, "workflows", self.models.parent / "workflows")

    @classmethod
    def from_settings(cls, settings: Settings, root: str | os.PathLike = ".demo") -> "DemoState":
        """The state of ``settings``: each of ``dagster_home``, ``lake``, ``landing``, ``models``,
        ``workflows`` where its variable is set, else its directory under ``root``. A project
        settings file is not asked: it is what the demo writes (:meth:`record`), and the state is
        where ``--state`` says."""
        base = Path(root)
        pick = lambda field, name: Path(getattr(settings, field) if settings.source(field) == "environment" else base / name).resolve()  # noqa: E731
        return cls(pick("dagster_home", "dagster_home"), pick("lake", "lake"), pick("landing", "landing"), pick("models", "models"),
                   pick("workflows", "workflows"))  # fmt: skip

    def directories(self) -> tuple[Path, ...]:
        return (self.home, self.lake, self.landing, self.models, self.workflows)

    def record(self, directory: str | os.PathLike = ".") -> Path | None:
        """Write the project settings file ``directory/.flowopt.toml`` naming these directories,
        so that every command run from ``directory`` finds this state without a variable
        (:func:`flow_assets.settings.write_demo_file`). Returns the file, or ``None`` when
        ``directory`` holds a settings file of a person's (left untouched)."""
        return write_demo_file(directory, {"dagster_home": self.home, "lake": self.lake, "landing": self.landing, "models": self.models,
                                           "workflows": self.workflows})  # fmt: skip

    def foreign(self) -> list[Path]:
        """Directories holding state without the demo's marker (someone else's data)."""
        return [d for d in self.directories() if d.is_dir() and not (d / MARKER).exists() and _state_entries(d)]

    def prepare(self, reset: bool = False) -> None:
        """Clear the demo's own state (and, with ``reset``, whatever is there), then mark every
        directory as the demo's.

        Raises:
            DemoStateError: a directory holds state the demo did not create and ``reset`` is false;
                nothing has been deleted then.
        """
        foreign = self.foreign()
        if foreign and not reset:
            listing = "; ".join(f"{d} ({len(_state_entries(d))} entries)" for d in foreign)
            raise DemoStateError(
                f"not the demo's state: {listing}. Pass --reset to delete it and start over, or point DAGSTER_HOME / "
                "FLOWOPT_LAKE / FLOWOPT_LANDING / FLOWOPT_MODELS / FLOWOPT_WORKFLOWS elsewhere (unset, the demo uses .demo/)"
            )
        for directory in self.directories():
            directory.mkdir(parents=True, exist_ok=True)
            for entry in _state_entries(directory):
                shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
            (directory / MARKER).write_text("state of `flowopt demo`: cleared by its next run\n")


def _state_entries(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.name not in _NOT_STATE)


def instance_cursor(instance) -> str | None:
    """The training sensor's cursor as this demo left it (kept in the instance's key-value store)."""
    return instance.run_storage.get_cursor_values({_TRAINING_CURSOR}).get(_TRAINING_CURSOR)


def save_cursor(instance, cursor: str | None) -> None:
    """Remember the training sensor's cursor between in-process ticks."""
    if cursor is not None:
        instance.run_storage.set_cursor_values({_TRAINING_CURSOR: cursor})
