"""The layers import one way, down, and no two modules import each other; SQL text goes
to the database through one door.

handlers -> plugins -> domain -> engine -> clients -> models/settings; ops beside the
domain (it reads what the engine and the domain keep); app and receiver.py wire it all."""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
BASE = {"models", "settings", "migrations"}
MAY_IMPORT = {
    "clients": {"clients", "settings"},
    "engine": {"engine", "clients"} | BASE,
    "domain": {"domain", "engine", "clients"} | BASE,
    "plugins": {"plugins", "domain", "engine", "clients"} | BASE,
    "ops": {"ops", "domain", "engine", "clients"} | BASE,
    "scheduler": {"domain", "engine", "ops", "clients"} | BASE,
    "handlers": {"handlers", "plugins", "domain", "engine", "ops", "clients"} | BASE,
}
OURS = set(MAY_IMPORT) | BASE | {"app", "receiver"}


def modules():
    for path in ROOT.glob("*.py"):
        yield path.stem, path
    for package in OURS:
        for path in (ROOT / package).rglob("*.py") if (ROOT / package).is_dir() else ():
            parts = path.relative_to(ROOT).with_suffix("").parts
            yield ".".join(p for p in parts if p != "__init__"), path


def imports_of(path):
    """Every module of ours that `path` imports, at any depth of the file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found |= {name for name in names if name.split(".")[0] in OURS}
    return found


GRAPH = {name: imports_of(path) for name, path in modules()}


def test_each_layer_imports_only_the_layers_below_it():
    wrong = []
    for module, imported in GRAPH.items():
        allowed = MAY_IMPORT.get(module.split(".")[0])
        if allowed is None:
            continue
        wrong += [f"{module} imports {name}" for name in sorted(imported)
                  if name.split(".")[0] not in allowed]
    assert wrong == []


def test_no_module_imports_one_that_imports_it_back():
    known = set(GRAPH)

    def reached(start):
        seen, todo = set(), [start]
        while todo:
            for name in GRAPH.get(todo.pop(), ()):
                if name in known and name not in seen:
                    seen.add(name)
                    todo.append(name)
        return seen

    cycles = sorted(module for module in GRAPH if module in reached(module))
    assert cycles == []


def test_the_rule_sees_a_wrong_import(tmp_path):
    # The check is only worth having if it notices: the engine reaching up to a plugin.
    wrong = tmp_path / "wrong.py"
    wrong.write_text("from plugins import registries\n")
    assert imports_of(wrong) == {"plugins", "plugins.registries"}
    assert "plugins" not in MAY_IMPORT["engine"]


# The modules that may send SQL text of their own, which no query builder sees: the door
# itself (models, engine.prepared); the scheduler's advisory lock, which writes nothing;
# the migrations, which run before the service serves.
SENDS_SQL_TEXT = {"models", "engine.prepared", "scheduler"}
SQL_TEXT_CALLS = {"execute_sql", "execute_prepared", "raw"}


def sends_sql_text(path):
    return any(isinstance(node, ast.Attribute) and node.attr in SQL_TEXT_CALLS
               for node in ast.walk(ast.parse(path.read_text(), str(path))))


def test_only_the_door_sends_sql_text():
    """Every write must pass by engine.commits.wrote, which drops the rows a turn read
    ahead (domain.orders.OrderAhead) when their table is written: a write sent as SQL
    text would pass it by, and a later unit of the turn would take a stale row."""
    senders = sorted(module for module, path in modules()
                     if module not in SENDS_SQL_TEXT and module.split(".")[0] != "migrations"
                     and sends_sql_text(path))
    assert senders == []


def test_the_rule_sees_sql_text(tmp_path):
    wrong = tmp_path / "wrong.py"
    wrong.write_text("database.execute_sql('UPDATE formation_orders SET notes = 1')\n")
    assert sends_sql_text(wrong)
