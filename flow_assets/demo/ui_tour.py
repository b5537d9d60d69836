"""``flowopt ui-tour``: the Dagster UI of a deployment, opened in headless Chromium, checked for
what a user must find there, and photographed.

Starts ``dagster-webserver`` on the workspace with the given environment (the demo's by
default), then visits, with Playwright driving the system's Chromium:

- Automation: every flowopt sensor, and its tick history (``training_round_sensor``'s page);
- Runs: runs launched by each sensor (the "Launched by" column);
- ``training_history``: the round table and the text chart of success per round;
- ``evaluation_report``'s checks: each gate check, and for a blocked round the failed check's
  reason (the latest execution, else the latest failed one in the check's execution history);
- the lineage around ``policy_checkpoint`` (champion -> rollouts -> logs -> round).

Each page is saved as ``<out>/ui-<name>.png``. Needs the ``ui`` extra (``pip install -e
'.[ui]'``) and a Chromium binary (Debian: ``apt-get install chromium``); no browser download.
"""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from flow_assets.runtime.local import REPO_ROOT, stop_process_group
from flow_assets.settings import Settings, child_environ

SENSORS = ("new_logs_sensor", "training_round_sensor", "training_history_sensor", "self_play_sensor")
CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "chrome")


class TourError(RuntimeError):
    """The UI could not be toured: no browser, no Playwright, or the webserver did not start."""


@dataclass
class TourResult:
    """What the tour found: ``found`` maps each check to the text that proves it (or ``None``
    when it is missing); ``screenshots`` the saved pages."""

    found: dict[str, str | None] = field(default_factory=dict)
    screenshots: list[Path] = field(default_factory=list)

    @property
    def missing(self) -> list[str]:
        return [name for name, proof in self.found.items() if proof is None]


def find_chromium(settings: Settings | None = None) -> str | None:
    """Path of a Chromium-family browser: ``settings.chromium`` (``FLOWOPT_CHROMIUM``; default
    settings: :meth:`Settings.load`, read now) when set and it exists, else the first on ``PATH``,
    else ``None``."""
    explicit = (settings or Settings.load()).chromium
    if explicit:
        return explicit if Path(explicit).exists() else None
    return next((p for p in map(shutil.which, CHROMIUM_NAMES) if p), None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_webserver(env: dict[str, str], port: int, timeout: float = 120.0) -> subprocess.Popen:
    exe = Path(sys.executable).with_name("dagster-webserver")
    proc = subprocess.Popen(
        [str(exe), "-w", str(REPO_ROOT / "workspace.yaml"), "-h", "127.0.0.1", "-p", str(port)],
        cwd=REPO_ROOT, env=child_environ(env), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/server_info", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            break
        time.sleep(1)
    proc.kill()
    raise TourError(f"dagster-webserver did not start on port {port} within {timeout:.0f} s")


def tour(
    env: dict[str, str], out_dir: Path, settle_ms: int = 4000, settings: Settings | None = None, wait_s: float = 60.0
) -> TourResult:
    """Tour the UI of the deployment that ``env`` (``DAGSTER_HOME``, ``FLOWOPT_*``, laid over this
    process's environment) describes and save screenshots in ``out_dir``; the browser is
    :func:`find_chromium` of ``settings``. Each page is given ``settle_ms`` (milliseconds) to
    render, then up to ``wait_s`` (seconds) more until the text its checks look for appears; a
    check whose text never appears is reported missing, not raised.

    Raises:
        TourError: Playwright or Chromium is missing, or the webserver did not start.
    """
    try:
        from playwright.sync_api import sync_playwright
    except ImportError as exc:
        raise TourError("Playwright is not installed: pip install -e '.[ui]'") from exc
    chromium = find_chromium(settings)
    if chromium is None:
        raise TourError("no Chromium found (apt-get install chromium, or set FLOWOPT_CHROMIUM)")
    out_dir.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    server = _start_webserver(env, port)
    result = TourResult()
    base = f"http://127.0.0.1:{port}"
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1500, "height": 950})

            def visit(path: str, *expect: str) -> str:
                # A page's data arrives by GraphQL after load; on a busy machine (CI runs the
                # suite two-wide) that took longer than any fixed pause, so wait for the text.
                page.goto(base + path)
                page.wait_for_timeout(settle_ms)
                return settle(*expect)

            def settle(*expect: str, limit_s: float = wait_s) -> str:
                deadline = time.monotonic() + limit_s
                while True:
                    skip = page.get_by_role("button", name="Skip")  # the first-visit newsletter dialog
                    if skip.count():
                        skip.first.click()
                        page.wait_for_timeout(300)
                    text = page.inner_text("body")
                    if all(e in text for e in expect) or time.monotonic() > deadline:
                        return text
                    page.wait_for_timeout(500)

            def record(name: str, text: str, *needles: str) -> None:
                result.found[name] = needles[0] if all(n in text for n in needles) else None

            def shoot(name: str) -> None:
                path = out_dir / f"ui-{name}.png"
                page.screenshot(path=str(path))
                result.screenshots.append(path)

            text = visit("/automation", *SENSORS)
            for sensor in SENSORS:
                record(f"sensor {sensor}", text, sensor)
            text = visit("/locations/flowopt/sensors/training_round_sensor", "Latest tick", "runs requested")
            record("tick history", text, "Latest tick", "runs requested")
            shoot("sensor")
            text = visit("/runs", *SENSORS)
            for sensor in SENSORS:
                record(f"runs launched by {sensor}", text, sensor)
            shoot("runs")
            text = visit("/assets/training_history?view=events", "champion_after")
            record("training_history table", text, "champion_after")
            shows = page.get_by_text("Show Markdown")
            if shows.count():
                shows.first.click()
                page.wait_for_timeout(800)
            text = settle("held-out success") if shows.count() else page.inner_text("body")
            record("training_history chart", text, "held-out success")
            shoot("training-history")
            if shows.count():
                page.keyboard.press("Escape")
            text = visit("/assets/evaluation_report?view=checks", "This is a blocking asset check")
            record("gate checks", text, "This is a blocking asset check")
            blocked = None
            for check in ("gain", "kl_bound", "finite_loss"):
                page.get_by_text(check, exact=True).first.click()
                page.wait_for_timeout(1500)
                text = settle("Evaluation result", limit_s=min(wait_s, 20.0))  # absent if the check never ran
                if re.search(r"Evaluation result\s+Failed", text):  # the latest round was blocked
                    start = text.find("Latest execution")
                    blocked = " ".join(text[start : start + 400].split()) if start >= 0 else check
                    shoot("gate-blocked")
                    break
                page.get_by_text("Execution history", exact=True).first.click()  # an earlier round's
                page.wait_for_timeout(2000)
                text = page.inner_text("body")
                history = text[text.find("Execution history") :]
                failed = re.search(r"\bFailed\b", history)
                if failed:
                    blocked = " ".join(history[failed.start() : failed.start() + 300].split())
                    shoot("gate-blocked")
                    break
            result.found["a blocked round's reason"] = blocked
            if blocked is None:
                shoot("gate")
            visit("/assets/policy_checkpoint?view=lineage&lineageDepth=6")
            shoot("lineage")
            browser.close()
    finally:
        stop_process_group(server, 30)
    return result
