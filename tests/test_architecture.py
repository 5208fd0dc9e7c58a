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
# itself (engine.connection, engine.joined, engine.prepared); the scheduler's advisory
# lock, which writes nothing; the migrations, which run before the service serves.
SENDS_SQL_TEXT = {"engine.connection", "engine.joined", "engine.prepared", "scheduler"}
SQL_TEXT_CALLS = {"execute_sql", "execute_prepared", "raw"}


def sends_sql_text(path):
    return any(isinstance(node, ast.Attribute) and node.attr in SQL_TEXT_CALLS
               for node in ast.walk(ast.parse(path.read_text(), str(path))))


def test_only_the_door_sends_sql_text():
    """Every write must pass by engine.commits.wrote, which drops the rows a turn read
    ahead (engine.store.orders.OrderAhead) when their table is written: a write sent as SQL
    text would pass it by, and a later unit of the turn would take a stale row."""
    senders = sorted(module for module, path in modules()
                     if module not in SENDS_SQL_TEXT and module.split(".")[0] != "migrations"
                     and sends_sql_text(path))
    assert senders == []


def test_the_rule_sees_sql_text(tmp_path):
    wrong = tmp_path / "wrong.py"
    wrong.write_text("database.execute_sql('UPDATE formation_orders SET notes = 1')\n")
    assert sends_sql_text(wrong)


# What the domain and the plugins are given instead: engine.transaction.Transaction, whose
# methods say what the business asks; how the engine does it stays behind them.
MACHINERY = {"peewee", "psycopg2", "playhouse", "engine.commits", "engine.prepared", "engine.db",
             "engine.store"}
# Query building and running, by the method's name: on anything (these names are the
# query builder's alone in our code), or on a model class (update: a dict has one too).
QUERY_CALLS = {"select", "insert", "insert_many", "insert_from", "delete", "execute",
               "execute_sql", "get_or_none", "get_or_create", "get_by_id", "create",
               "save", "for_update", "save_changes", "savepoint"}
ON_A_MODEL = {"update", "get", "replace"}


def machinery_in(path):
    """What of the engine's machinery `path` names: modules it imports, queries it builds."""
    tree = ast.parse(path.read_text(), str(path))
    found = set()
    models = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            if node.module == "models":
                models |= {alias.asname or alias.name for alias in node.names}
        else:
            continue
        found |= {f"imports {name}" for name in names
                  if any(name == banned or name.startswith(banned + ".") for banned in MACHINERY)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            method, receiver = node.func.attr, node.func.value
            if isinstance(receiver, ast.Name) and receiver.id == "tx":
                continue  # the transaction's own methods are what they may call
            on_a_model = isinstance(receiver, ast.Name) and (
                receiver.id in models or receiver.id == "model")
            if method in QUERY_CALLS or (method in ON_A_MODEL and on_a_model):
                found.add(f"calls .{method}() (line {node.lineno})")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id in {"save_changes", "savepoint", "locked", "write_later"}:
            found.add(f"calls {node.func.id}() (line {node.lineno})")
    return found


def test_the_domain_and_the_plugins_speak_only_to_the_transaction():
    """domain/ and plugins/ read and write through engine.transaction.Transaction alone:
    no peewee, no engine.commits/prepared/db/store, no query of their own. A rule or a
    plugin then reads as what the business asks, and the engine may change how it is
    done (rows read ahead for the turn, held writes, statements joined into one round
    trip) without a change to them."""
    wrong = sorted(f"{module} {what}" for module, path in modules()
                   if module.split(".")[0] in ("domain", "plugins")
                   for what in machinery_in(path))
    assert wrong == []


def test_the_rule_sees_a_query_in_the_domain(tmp_path):
    wrong = tmp_path / "wrong.py"
    wrong.write_text(
        "import peewee\n"
        "from models import ComplianceOrder, ORDER_MODELS\n"
        "from engine.commits import savepoint\n"
        "def slug(tx, number, found):\n"
        "    found.update(number=number)\n"
        "    tx.save(found)\n"
        "    ComplianceOrder.update(notes='x').execute()\n"
        "    for model in ORDER_MODELS.values():\n"
        "        model.select().where(model.order_number == number).first()\n")
    assert machinery_in(wrong) == {
        "imports peewee", "imports engine.commits", "imports engine.commits.savepoint",
        "calls .update() (line 7)", "calls .execute() (line 7)", "calls .select() (line 9)"}
