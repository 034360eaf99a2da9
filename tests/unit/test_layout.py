"""The app's layout rules, read from its source: no import cycle, no import hidden in a function to
dodge one, and every hand-written statement run on its manager's database alias."""
from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

APP = Path(__file__).resolve().parents[2] / "dispatcher"

# The only imports inside functions, each for a reason other than a cycle.
FUNCTION_LOCAL_IMPORTS = {
    # AppConfig.ready(): runs once the registry is ready; these modules register checks and signals.
    ("apps", "django.utils.module_loading"), ("apps", "dispatcher"), ("apps", "dispatcher.beat"),
    ("apps", "dispatcher.liveness"), ("apps", "dispatcher.redact"), ("apps", "dispatcher.storedtimes"), ("apps", "dispatcher.store"),
    ("apps", "celery.signals"), ("apps", "dispatcher.httpclient"), ("apps", "dispatcher.worker"),
    ("apps", "django.contrib"),
    # The package root is imported while INSTALLED_APPS load, before models may be defined; the
    # function it exports from the limiter's learning is imported when first asked for.
    ("dispatcher", "dispatcher.learning"),
    # The PostgreSQL driver: only a PostgreSQL connection needs it (SQLite runs without it installed).
    ("dispenser", "psycopg"), ("storedtimes", "psycopg.postgres"), ("storedtimes", "psycopg.pq"),
    # A Python may be built without sqlite3; the call falls back to Django's batching.
    ("send", "sqlite3"),
    # django_celery_beat's models need its app installed; only the beat schedules use them.
    ("beat", "django_celery_beat.models"),
}


@functools.cache
def _modules() -> dict[str, ast.Module]:
    modules = {}
    for path in APP.rglob("*.py"):
        if "migrations" in path.parts:
            continue
        name = ".".join(path.relative_to(APP.parent).with_suffix("").parts).removesuffix(".__init__")
        modules[name] = ast.parse(path.read_text(), str(path))
    return modules


def _runtime_imports(tree: ast.Module) -> list[tuple[ast.stmt, bool]]:
    """Every import run when the module loads or a function runs (not the ``if TYPE_CHECKING:`` ones)."""
    found: list[tuple[ast.stmt, bool]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and ast.unparse(child.test) == "TYPE_CHECKING":
                continue
            if isinstance(child, ast.Import | ast.ImportFrom):
                found.append((child, in_function))
            visit(child, in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef))

    visit(tree, False)
    return found


def _targets(node: ast.stmt, modules: dict[str, ast.Module]) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    assert isinstance(node, ast.ImportFrom)
    base = node.module or ""
    # "from dispatcher import limiter" imports the submodule; "from dispatcher import handler", the package.
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]


def test_the_app_has_no_import_cycle():
    modules = _modules()
    graph = {
        name: {t for node, _ in _runtime_imports(tree) for t in _targets(node, modules) if t in modules and t != name}
        for name, tree in modules.items()
    }
    cycles = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def walk(name: str) -> None:
        state[name] = 1
        stack.append(name)
        for target in sorted(graph[name]):
            if state.get(target) == 1:
                cycles.append(" -> ".join([*stack[stack.index(target):], target]))
            elif target not in state:
                walk(target)
        stack.pop()
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            walk(name)
    assert cycles == []


def test_no_import_is_hidden_in_a_function_but_the_listed_ones():
    modules = _modules()
    local = {
        (name.removeprefix("dispatcher.").rsplit(".", 1)[-1], target)
        for name, tree in modules.items()
        for node, in_function in _runtime_imports(tree) if in_function
        for target in ([node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names])
    }
    assert local == FUNCTION_LOCAL_IMPORTS


@pytest.mark.parametrize("module", [
    "models", "managers", "calls.rows", "calls.send", "calls.dispense", "calls.start", "calls.finish", "calls.sweep",
    "calls.shares", "limits.edit", "limits.catalog", "limits.gate", "limits.ledger", "limits.locks", "store.schema",
    "store.limit_sql", "store.call_sql", "store.inserts", "store.folded", "clock",
    "learning", "tables",
])
def test_the_models_and_the_modules_below_them_import_no_model_module(module):
    tree = _modules()[f"dispatcher.{module}"]
    imported = {t for node, _ in _runtime_imports(tree) for t in _targets(node, _modules())}
    assert "dispatcher.models" not in imported or module == "models"


def test_no_statement_runs_on_the_default_connection():
    """Statements run on ``connections[alias]`` with their manager's alias (``self.db``, or
    ``locks.alias()``); the default ``connection`` is imported only to be closed, by a greenlet
    (tasks) or the heartbeat thread (liveness)."""
    importers = set()
    for name, tree in _modules().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "django.db":
                if any(alias.name == "connection" for alias in node.names):
                    importers.add(name)
    assert importers == {"dispatcher.tasks", "dispatcher.liveness"}


def test_states_and_outcomes_are_named_by_their_enums_not_by_literals():
    """``CallQueue.Status`` / ``Attempt.Outcome`` (dispatcher.states), never ``"pending"`` in a comparison or filter."""
    from dispatcher.states import AttemptOutcome, CallStatus

    values = set(CallStatus.values) | set(AttemptOutcome.values)

    def literal(node: ast.AST) -> bool:
        if isinstance(node, ast.Constant):
            return node.value in values
        return isinstance(node, ast.List | ast.Tuple | ast.Set) and any(literal(e) for e in node.elts)

    found = []
    for name, tree in _modules().items():
        if name == "dispatcher.states":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare) and any(literal(c) for c in [node.left, *node.comparators]):
                found.append(f"{name}:{node.lineno}")
            if isinstance(node, ast.keyword) and node.arg in {"status", "status__in", "outcome", "outcome__in"}:
                if literal(node.value):
                    found.append(f"{name}:{node.value.lineno}")
    assert found == []


# A module holds one concern; past this many lines it holds several (the anchors' largest are
# 370-1,050 lines, each one concern). Migrations are generated, not read.
MAX_MODULE_LINES = 500


def test_no_module_of_the_app_is_longer_than_the_limit():
    long = {
        str(path.relative_to(APP.parent)): lines
        for path in APP.rglob("*.py")
        if "migrations" not in path.parts and (lines := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert long == {}


def test_the_running_call_has_one_context_variable():
    """What a worker knows of the call it runs lives in one object (``dispatcher.running.Run``) held
    by one ContextVar; the Tasks backend's own flag (a task enqueued from inside a send) is the only
    other one."""
    assert _modules_calling("ContextVar") == {"dispatcher.running", "dispatcher.backends"}


def test_the_tables_import_nothing_of_the_engine():
    """``dispatcher.tables`` sits below the engine that reads and writes it: the limiter and the calls
    import its model classes, so it may import only the pure shapes and the vocabularies."""
    tree = _modules()["dispatcher.tables"]
    imported = {t for node, _ in _runtime_imports(tree) for t in _targets(node, _modules())}
    assert {name for name in imported if name.startswith("dispatcher")} <= {"dispatcher.limits.shapes", "dispatcher.states"}


def test_no_module_looks_a_model_up_by_name_but_the_listed_ones():
    """No proxy stands between a module and the tables: the one lookup by name is the Tasks
    backend's (it loads in sites that may not install the app), and ``store.schema`` reads a
    model's columns to write SQL text."""
    assert _modules_calling("get_model") == {"dispatcher.backends", "dispatcher.store.schema"}


def _modules_calling(name: str) -> set[str]:
    """The app's modules with a call of a function whose name ends with ``name``."""
    return {
        module
        for module, tree in _modules().items()
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and ast.unparse(node.func).endswith(name)
    }
