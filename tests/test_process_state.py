"""flowopt changes no process-wide environment at run time.

The gateway samples in its own thread while a run evaluates, and httpx, transformers and Dagster
read ``os.environ`` whenever they like: a variable set and deleted around a call crashed a demo
(``KeyError`` inside httpx's proxy lookup). A setting is passed explicitly instead; this test reads
every module of the code location so that no new mutation slips in. The warning filters are
process-wide too: ``warnings.catch_warnings`` swaps them, so it is refused as well.
"""

import ast

from tests.fresh import call_in_fresh_interpreter, code_location_modules

MUTATORS = {"pop", "update", "setdefault", "clear", "popitem", "__setitem__", "__delitem__"}


def _is_environ(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "environ" and isinstance(node.value, ast.Name) and node.value.id == "os"


def environment_mutations(tree: ast.AST) -> list[int]:
    """Line numbers of ``os.environ[...] = / del os.environ[...] / os.environ.pop|update|... /
    os.putenv / os.unsetenv`` in a module's ``tree`` (``ast.parse``)."""
    lines = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        if any(isinstance(t, ast.Subscript) and _is_environ(t.value) for t in targets):
            lines.append(node.lineno)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            func = node.func
            if func.attr in MUTATORS and _is_environ(func.value):
                lines.append(node.lineno)
            if func.attr in ("putenv", "unsetenv") and isinstance(func.value, ast.Name) and func.value.id == "os":
                lines.append(node.lineno)
    return lines


def test_the_scanner_finds_every_shape_of_mutation():
    source = "import os\nos.environ['A'] = '1'\ndel os.environ['A']\nos.environ.pop('A', None)\nos.environ.update(a='1')\nos.putenv('A', '1')\nx = os.environ.get('A')\n"
    assert environment_mutations(ast.parse(source)) == [2, 3, 4, 5, 6]


def scan() -> dict[str, dict[str, list[int]]]:
    """Every module of the code location read by each finder (:func:`environment_mutations`,
    :func:`filter_swaps`): finder name -> (path relative to the repository -> line numbers),
    modules without any left out."""
    finders = {"environment_mutations": environment_mutations, "filter_swaps": filter_swaps}
    found: dict[str, dict[str, list[int]]] = {name: {} for name in finders}
    for path, source in code_location_modules():
        tree = ast.parse(source)
        for name, finder in finders.items():
            if lines := finder(tree):
                found[name][str(path)] = lines
    return found


def test_no_module_of_the_code_location_changes_the_process_environment():
    found = call_in_fresh_interpreter(scan)["environment_mutations"]  # ast.parse beside other threads: tests/fresh.py
    assert found == {}, f"pass the setting explicitly instead of changing os.environ: {found}"


def filter_swaps(tree: ast.AST) -> list[int]:
    """Line numbers of ``warnings.catch_warnings(...)`` in a module's ``tree``: it saves and restores the
    process-wide warning filters on entry and exit, so two threads using it at once (agents
    calling a tool) can leave either one's filters in place for everybody."""
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "catch_warnings"
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "warnings"
    ]


def test_the_filter_scanner_finds_catch_warnings():
    assert filter_swaps(ast.parse("import warnings\nwith warnings.catch_warnings():\n    pass\nwarnings.warn('x')\n")) == [2]


def test_no_module_of_the_code_location_swaps_the_warning_filters():
    found = call_in_fresh_interpreter(scan)["filter_swaps"]
    assert found == {}, f"warnings.catch_warnings is not thread-safe; avoid the warning instead: {found}"
