"""Every module of flow_assets sits in a layer of the import-linter contract (pyproject.toml), so
`lint-imports` (run by `make test`) checks its imports: a new module must be placed, not escape."""

import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _modules() -> set[str]:
    """Every module and package under flow_assets, dotted (a package by its own name)."""
    found = set()
    for path in (REPO / "flow_assets").rglob("*.py"):
        parts = path.relative_to(REPO).with_suffix("").parts
        found.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return found - {"flow_assets"}


def test_every_flow_assets_module_is_in_a_layer():
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    (contract,) = [c for c in config["contracts"] if c["type"] == "layers"]
    placed = {name.strip() for layer in contract["layers"] for name in layer.replace("|", ":").split(":")}

    def is_placed(module: str) -> bool:
        parts = module.split(".")
        return any(".".join(parts[:n]) in placed for n in range(2, len(parts) + 1))

    def is_container(module: str) -> bool:  # a domain package whose modules are placed one by one
        return any(name.startswith(module + ".") for name in placed)

    missing = sorted(m for m in _modules() if not is_placed(m) and not is_container(m))
    assert not missing, f"place these in a layer of [tool.importlinter] in pyproject.toml: {missing}"
    assert {"resources", "sensors"} <= placed


def test_every_domain_package_says_what_it_holds():
    """A domain folder's __init__ docstring is where a newcomer learns what lives there."""
    bare = [str(p.relative_to(REPO)) for p in (REPO / "flow_assets").glob("*/__init__.py") if not p.read_text().strip()]
    assert not bare, f"give these domain packages a docstring: {bare}"
