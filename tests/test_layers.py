"""Every module of flow_assets sits in a layer of the import-linter contract (pyproject.toml), so
`lint-imports` (run by `make test`) checks its imports: a new module must be placed, not escape."""

import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_every_flow_assets_module_is_in_a_layer():
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    (contract,) = [c for c in config["contracts"] if c["type"] == "layers"]
    placed = {name.strip() for layer in contract["layers"] for name in layer.replace("|", ":").split(":")}
    modules = {f"flow_assets.{p.stem}" for p in (REPO / "flow_assets").glob("*.py") if p.stem != "__init__"}
    packages = {f"flow_assets.{p.parent.name}" for p in (REPO / "flow_assets").glob("*/__init__.py")}
    missing = sorted((modules | packages) - placed)
    assert not missing, f"place these in a layer of [tool.importlinter] in pyproject.toml: {missing}"
    assert {"resources", "sensors"} <= placed
