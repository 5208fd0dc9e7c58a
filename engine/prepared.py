"""Statements built once and run many times.

Peewee builds a query's SQL anew each time it runs, and on this machine that costs about
0.3 ms for a select of one row that SQLite then runs in 12 µs (docs/PERFORMANCE.md). The
request path runs the same dozen statements on every call, so those are written as
peewee queries with named slots where the values go, compiled once per database, and run
with new values bound in. On PostgreSQL those whose plan cannot go wrong are also
prepared on the server (`ServerSide`), which then neither parses nor plans them again.
"""
import itertools
import re
from typing import Any, Callable, Iterable, Mapping, Sequence

import peewee

from models import POSTGRES_FIELD_TYPES, database, is_postgres
from engine import commits


# A value a statement takes, as the caller gives it (a Slot's) or as it goes (bound).
Values = Mapping[str, Any]
# What builds a condition on the row being inserted, of a name of its values (InsertMany).
Batch = Callable[[str], peewee.Entity]


class Slot(peewee.Node):
    """Where a value goes; `field` converts it the way peewee would (a datetime to UTC
    text, say)."""

    def __init__(self, name: str, field: peewee.Field | None = None) -> None:
        self.name = name
        self.convert = field.db_value if field is not None else None
        # Its type in a PREPARE: its column's, or left to the server to infer.
        self.server_type = (SERVER_TYPES.get(field.field_type, "unknown")
                            if field is not None else "unknown")

    def bind(self, values: Values) -> Any:
        value = values[self.name]
        return self.convert(value) if self.convert else value

    def __sql__(self, ctx: Any) -> Any:
        ctx._values.append(self)
        return ctx.literal(ctx.state.param or "?")


# PostgreSQL's names of the column types a slot may fill (models' field types).
SERVER_TYPES = {"AUTO": "integer", "BIGAUTO": "bigint", "INT": "integer",
                "BIGINT": "bigint", "BOOL": "boolean", "TEXT": "text",
                **{field_type: name.lower() for field_type, name in POSTGRES_FIELD_TYPES.items()}}
_server_names = itertools.count(1)


class ServerSide:
    """A compiled statement as PostgreSQL prepares it (engine.connection.ServiceDatabase
    .execute_prepared): its PREPARE, with its constants written in and its slots as
    typed parameters, and its EXECUTE, given the slots' values alone."""

    def __init__(self, sql: str, params: list) -> None:
        self.sql = sql
        self.name = f"receiver_{next(_server_names)}"
        self._params = params
        self._slots = [n for n, param in enumerate(params) if isinstance(param, Slot)]
        self.execute = (f"EXECUTE {self.name}({', '.join(['%s'] * len(self._slots))})"
                        if self._slots else f"EXECUTE {self.name}")

    def arguments(self, bound: list) -> list:
        """The EXECUTE's values, of all the statement's bound ones."""
        return [bound[n] for n in self._slots]

    def prepare_text(self, cursor: Any) -> bytes:
        """The PREPARE, its constants written in as `cursor` would send them."""
        params = iter(self._params)
        text, types = [], []
        for piece in re.split(r"(%%|%s)", self.sql):
            if piece == "%%":
                text.append("%")
            elif piece != "%s":
                text.append(piece)
            elif isinstance(param := next(params), Slot):
                types.append(param.server_type)
                text.append(f"${len(types)}")
            else:
                text.append(cursor.mogrify("%s", (param,)).decode())
        typed = f"({', '.join(types)})" if types else ""
        return f"PREPARE {self.name}{typed} AS {''.join(text)}".encode()


def slot(field: peewee.Field, name: str | None = None) -> Any:
    """A value for `field`, named after it unless `name` says otherwise: a Slot, which
    stands wherever peewee takes a column or a value (hence Any, as peewee's are)."""
    return Slot(name or field.name, field)


class Prepared:
    """`build()` returns a peewee query whose values are slots; `execute(**values)` runs it.

    `on_server`: on PostgreSQL, prepared on the server too (`ServerSide`), which then
    keeps one plan for the connection, made without the values. Only for a statement
    whose every read goes by equality on the primary key or on a whole unique key: that
    plan is then the right one whatever the tables hold. A plan made without the values
    may otherwise pick a worse index for good (on a new, small table: one that holds the
    whole range a dedup window reads). tests/test_held_writes.py holds each to that."""

    # Every statement prepared on the server, for the test of their plans.
    on_server_statements: list["Prepared"] = []

    def __init__(self, build: Callable[[], peewee.Query], on_server: bool = False) -> None:
        self._build = build
        self._compiled: tuple | None = None
        self.on_server = on_server
        if on_server:
            self.on_server_statements.append(self)

    def _statement(self) -> tuple[Any, str, list, Any, ServerSide | None, bool]:
        db = database.obj
        if self._compiled is None or self._compiled[0] is not db:
            query = self._build()
            sql, params = query.sql()
            if isinstance(query, peewee.Insert) and not all(
                    isinstance(param, Slot) for param in params):
                # Peewee fills a column left out with its default, computed now: a
                # creation time would be frozen into the statement.
                raise ValueError(f"every column of a prepared insert needs a slot: {sql}")
            server = (ServerSide(sql, params) if self.on_server and db.sends_several_at_once
                      else None)
            self._compiled = (db, sql, params, getattr(query, "model", None), server,
                              isinstance(query, peewee._WriteQuery))
        return self._compiled

    def execute(self, **values: Any) -> Any:
        db, sql, params, model, server, writes = self._statement()
        if writes:
            self._tell_turn(model, values)
        if server is None:
            return db.execute_sql(sql, self._bound(params, values))
        return db.execute_prepared(server, self._bound(params, values))

    def execute_later(self, **values: object) -> None:
        """`execute` for a write whose result is not read: in a turn of the group commit
        on PostgreSQL it goes to the server with the next statement (engine.commits)."""
        db, sql, params, model, server, writes = self._statement()
        if writes:
            self._tell_turn(model, values)
        db.write_later(sql, self._bound(params, values), prepared=server)

    def ahead(self, take: Callable[[list[str], list[tuple]], None],
              **values: object) -> commits.AheadStatement:
        """The statement with `values` bound, for an `engine.commits.Ahead` kind: sent
        with the turn's other statements ahead, in one; `take(names, rows)` gets what it
        returned."""
        db, sql, params, model, server, writes = self._statement()
        if writes:
            self._tell_turn(model, values)
        return commits.AheadStatement(sql, self._bound(params, values), take)

    def _tell_turn(self, model: Any, values: Values) -> None:
        """A write: the rows of its table kept for the turn are dropped (commits.wrote)."""
        commits.wrote(model)

    @staticmethod
    def _bound(params: list, values: Values) -> list:
        return [param.bind(values) if isinstance(param, Slot) else param for param in params]

    def first(self, **values: Any) -> Any:
        """Run a select; its first row as a model instance, or None."""
        cursor = self.execute(**values)
        row = cursor.fetchone()
        return None if row is None else self.instances(_names(cursor), [row])[0]

    def all(self, **values: Any) -> list[Any]:
        """Run a select; its rows as model instances."""
        cursor = self.execute(**values)
        return self.instances(_names(cursor), cursor.fetchall())

    def instances(self, names: list[str], rows: list[tuple]) -> list[Any]:
        """Rows of this select, their columns named `names`, as model instances."""
        model = self._statement()[3]
        columns = model._meta.columns
        fields = [columns[name] for name in names]
        found = []
        for row in rows:
            instance = model(__no_default__=1, **{field.name: field.python_value(value)
                                                  for field, value in zip(fields, row)})
            instance._dirty.clear()  # as peewee leaves a row it read: nothing to save yet
            found.append(instance)
        return found


class InsertOnce(Prepared):
    """An insert of a row of `model` unless a unique key already holds one (ON CONFLICT DO
    NOTHING: two racing inserts of the same key end with one row, and a duplicate raises
    nothing, so an enclosing transaction goes on). Every column but the id is written; a
    value left out is the field's default, computed at each run."""

    def __init__(self, model: type[peewee.Model],
                 also_returning: Iterable[tuple[str, Callable[[], Any]]] = (),
                 unless: Callable[[], peewee.Select] | None = None) -> None:
        """`also_returning`: (name, build) pairs, expressions (build() gives one) the insert
        returns beside the new row's id, set on the row `row()` gives under `name`: what
        would otherwise be a read of its own after the insert, in the same round trip.

        `unless`: builds a select; when it finds a row, nothing is inserted, as when the
        unique key is taken: what would otherwise be a read of its own before the
        insert. Its slots' values are given to `run` or `row` beside the columns'."""
        self.fields = _written_fields(model)
        self.also_returning = tuple(also_returning)
        # An insert that reads nothing but its unique keys' indexes (ON CONFLICT).
        reads_nothing = unless is None and not self.also_returning

        def build() -> peewee.Query:
            values = {field: slot(field) for field in self.fields}
            if unless is None:
                query = model.insert(values)
            else:
                query = model.insert_from(
                    peewee.Select(columns=[_as_column(field, value)
                                           for field, value in values.items()])
                    .where(~peewee.fn.EXISTS(unless())), list(values))
            query = self._on_conflict(query)
            if self.also_returning:
                query = query.returning(model._meta.primary_key, *(
                    expression().alias(name) for name, expression in self.also_returning))
            return query
        super().__init__(build, on_server=reads_nothing)

    def run(self, **values: Any) -> Any:
        """The new row's id (True for a table without one), or None when it was there."""
        returned = self._insert(values)
        return None if returned is None else returned[0]

    def row(self, **values: Any) -> Any:
        """The new row as a model instance, or None when it was there. Every column was
        written from `values`, so the row is not read back."""
        returned = self._insert(values)
        if returned is None:
            return None
        instance = _written(self._statement()[3], self.fields, returned[0], values)
        for (name, _), value in zip(self.also_returning, returned[1:]):
            setattr(instance, name, value)
        return instance

    def run_later(self, **values: Any) -> None:
        """`run` for an insert whose outcome nobody reads (a row the unique key may
        already hold, and none the worse for it): sent as `execute_later` sends, with the
        next statement in a turn on PostgreSQL."""
        self.execute_later(**self._with_defaults(values))

    def _insert(self, values: dict[str, Any]) -> tuple | None:
        """The RETURNING row (the new id first), or None when the row was there."""
        cursor = self.execute(**self._with_defaults(values))
        if cursor.description:  # RETURNING: PostgreSQL's always, SQLite's when asked
            row = cursor.fetchone()
            return tuple(row) if row else None
        return ((cursor.lastrowid or True),) if cursor.rowcount == 1 else None

    def _with_defaults(self, values: dict[str, Any]) -> dict[str, Any]:
        return _with_defaults(self.fields, values)

    def _on_conflict(self, query: Any) -> Any:
        return query.on_conflict("nothing")


class InsertOrUpdate(InsertOnce):
    """An insert of a row of `model` as InsertOnce writes one, unless the unique index
    of `key` holds a row: that row's `updating` columns then take the new row's values,
    where `only_if()` holds (ON CONFLICT ... DO UPDATE ... WHERE). One statement for
    what would be an insert, a look at its outcome and an update: sent with the next one
    (`run_later`), as nobody reads what it did. `unless`: as InsertOnce's (nothing is
    inserted nor updated when it finds a row)."""

    def __init__(self, model: type[peewee.Model], key: peewee.Field,
                 updating: Sequence[peewee.Field], only_if: Callable[[], peewee.Node],
                 unless: Callable[[], peewee.Select] | None = None) -> None:
        self._key, self._updating, self._only_if = key, updating, only_if
        super().__init__(model, unless=unless)

    def _on_conflict(self, query: Any) -> Any:
        return query.on_conflict(
            conflict_target=[self._key], where=self._only_if(),
            update={field: getattr(peewee.EXCLUDED, field.column_name)
                    for field in self._updating})


class ArraySlot(Slot):
    """Where a list of values goes, each converted as `field` converts one."""

    def __init__(self, name: str, field: peewee.Field | None = None) -> None:
        super().__init__(name, field)
        if self.server_type != "unknown":
            self.server_type += "[]"

    def bind(self, values: Values) -> list:
        convert = self.convert
        return [convert(value) if convert else value for value in values[self.name]]


class InsertMany(Prepared):
    """Several rows of `model` in one INSERT, as InsertOnce writes one (ON CONFLICT DO
    NOTHING, every column but the id given, a value left out the field's default); for
    a database that sends several statements at once (PostgreSQL), where each row's own
    statement would be a round trip of its own. Each column's values go as one array,
    which the server unnests: the statement is the same whatever the number of rows.

    `returning()` gives the expressions RETURNING yields for each new row (the rows a
    unique key already held yield nothing). `extra`: per-row values that are not columns
    (name: the field whose type and conversion they take), for `unless(batch)`, which
    builds the condition a row must meet to be inserted, `batch(name)` naming a value of
    the row (a column's or an extra one).

    The ids are in the arrays' order: the newest id is the last row asked for. The
    outbox sends an order's rows in the order of their ids, and the inbox's arrival
    order, (received_at, id), falls to the id when two calls of an order were stamped
    with one time (the clock counts microseconds, and may be set back). That rests only
    on what PostgreSQL documents, not on the order in which it evaluates a select list
    or inserts the rows of a select: one id is drawn from the id's sequence for each row
    (`nextval`, "Sequence Manipulation Functions": distinct values, each greater than
    those this session drew before) in a WITH query that calls a volatile function,
    which PostgreSQL evaluates once per execution of the statement and never folds into
    it (MATERIALIZED, PostgreSQL 12 on: "WITH Queries (Common Table Expressions)"); the
    drawn ids, sorted (an aggregate's ORDER BY, "Aggregate Expressions"), go to the rows
    by their position in the arrays (WITH ORDINALITY, "Table Functions").

    `in_order_of`: the columns of a unique key. Of two rows under one such key only the
    first in the arrays' order is inserted (DISTINCT ON, SELECT's "DISTINCT Clause");
    of two rows under another unique key, which one is kept is not promised. The rows
    are inserted in the key's order (an ORDER BY on the select that feeds the insert),
    the arrays' order after it. Two processes inserting the same keys in opposite
    orders may each hold a key the other waits for; in the key's order the second
    usually waits for the first and finds its keys taken. PostgreSQL does not document
    that an INSERT takes its rows in the order of its select, so this only makes
    deadlocks rarer: a deadlock, or a lock waited for past lock_timeout, is a conflict,
    and its turn is run again (engine.commits)."""

    def __init__(self, model: type[peewee.Model],
                 returning: Callable[[], Sequence[peewee.Node]],
                 extra: dict[str, peewee.Field] | None = None,
                 unless: Callable[[Batch], peewee.Node] | None = None,
                 in_order_of: Sequence[str] = ()) -> None:
        self.fields = _written_fields(model)
        self.extra = extra = extra or {}

        def batch(name: str) -> peewee.Entity:
            return peewee.Entity("batch", name)

        def build() -> peewee.Query:
            named = {field.column_name: field for field in self.fields}
            named.update(extra)
            arrays = [peewee.Cast(ArraySlot(name, field),
                                  f"{SERVER_TYPES[field.field_type]}[]")
                      for name, field in named.items()]
            given = peewee.NodeList((
                peewee.fn.unnest(*arrays), peewee.SQL("WITH ORDINALITY AS"),
                peewee.Entity("given"), peewee.EnclosedNodeList(
                    [peewee.Entity(name) for name in (*named, "position")])))
            rows = peewee.Select(from_list=[given], columns=[peewee.SQL("*")]).cte("batch")
            primary_key = _primary_key(model)
            sequence = peewee.SQL(f"pg_get_serial_sequence('{model._meta.table_name}', "
                                  f"'{primary_key.column_name}')")
            draws = peewee.Select(from_list=[peewee.Entity("batch")], columns=[
                peewee.fn.nextval(sequence).alias("draw")]).alias("draws")
            draw = peewee.Entity("draws", "draw")
            drawn = peewee.Select(from_list=[draws], columns=[peewee.fn.array_agg(
                peewee.NodeList((draw, peewee.SQL("ORDER BY"), draw))).alias("ids")]).cte(
                    "drawn", materialized=True)
            row_id = peewee.NodeList((peewee.Entity("drawn", "ids"), peewee.SQL("["),
                                      batch("position"), peewee.SQL("]")), glue="")
            select = peewee.Select(
                from_list=[peewee.Entity("batch"), peewee.Entity("drawn")],
                columns=[row_id, *(batch(field.column_name) for field in self.fields)],
            ).order_by(*(batch(name) for name in in_order_of), batch("position"))
            if in_order_of:
                select = select.distinct(*(batch(name) for name in in_order_of))
            if unless is not None:
                select = select.where(unless(batch))
            return (model.insert_from(select.with_cte(rows, drawn), [primary_key, *self.fields])
                    .on_conflict("nothing").returning(*returning()))
        super().__init__(build)

    def written(self, row_id: int, values: dict) -> Any:
        """The row `rows` wrote from `values` and gave `row_id`, as a model instance: every
        column was written from `values`, so the row is not read back."""
        return _written(self._statement()[3], self.fields, row_id, values)

    def rows(self, rows: list[dict]) -> list[tuple]:
        """Insert `rows` (each a dict of values by name: the fields' and the extra
        ones); RETURNING's rows, one for each row inserted."""
        return list(self.execute(**self._by_column(rows)).fetchall())

    def ahead_rows(self, rows: list[dict],
                   take: Callable[[list[str], list[tuple]], None]) -> commits.AheadStatement:
        """`rows` as `Prepared.ahead` asks for a statement: `take` gets RETURNING's."""
        return self.ahead(take, **self._by_column(rows))

    def _by_column(self, rows: list[dict]) -> dict[str, list]:
        for row in rows:
            _with_defaults(self.fields, row)
        by_column = {field.column_name: [row[field.name] for row in rows]
                     for field in self.fields}
        by_column.update({name: [row[name] for row in rows] for name in self.extra})
        return by_column


def _names(cursor: Any) -> list[str]:
    return [column[0] for column in cursor.description]


def _written_fields(model: type[peewee.Model]) -> list[peewee.Field]:
    """The columns an insert writes: every one but the id."""
    return [field for field in model._meta.sorted_fields
            if not isinstance(field, peewee.AutoField)]


def _with_defaults(fields: Sequence[peewee.Field], values: dict[str, Any]) -> dict[str, Any]:
    """`values`, each field left out given its default, computed now."""
    for field in fields:
        if field.name not in values:
            default = field.default
            values[field.name] = default() if callable(default) else default
    return values


def _written(model: type[peewee.Model], fields: Sequence[peewee.Field], row_id: object,
             values: Values) -> Any:
    instance: Any = model(__no_default__=1, **{_primary_key(model).name: row_id},
                     **{field.name: values[field.name] for field in fields})
    instance._dirty.clear()  # as peewee leaves a row it wrote: nothing to save yet
    return instance


def _primary_key(model: type[peewee.Model]) -> peewee.Field:
    """`model`'s primary key (every model of ours has one)."""
    primary_key = model._meta.primary_key
    assert primary_key, model
    return primary_key


def _as_column(field: peewee.Field, value: peewee.Node) -> peewee.Node:
    """`value` typed as `field`'s column, in a select that feeds an insert: PostgreSQL
    takes an untyped parameter there for text (a NULL too), which a timestamp or integer
    column refuses. SQLite needs no cast, and would turn a time's text into a number."""
    if not is_postgres():
        return value
    return peewee.Cast(value, POSTGRES_FIELD_TYPES.get(field.field_type, field.field_type))


_SAVES: dict[tuple, Prepared] = {}


def save_changes(instance: Any) -> None:
    """`instance.save()` for a model with only_save_dirty: the changed columns are
    written, with the update's SQL built once per set of changed columns, and sent with
    the next statement (`Prepared.execute_later`)."""
    model = type(instance)
    changed = tuple(sorted(instance.dirty_fields, key=lambda field: field.name))
    if not changed:
        return
    key = (model, changed)
    statement = _SAVES.get(key)
    if statement is None:
        primary_key = model._meta.primary_key
        statement = _SAVES[key] = _SaveOfOneRow(lambda: model.update(
            {field: slot(field) for field in changed}).where(primary_key == slot(primary_key)),
            on_server=True)
    statement.execute_later(**{field.name: instance.__data__[field.name]
                               for field in (*changed, model._meta.primary_key)})
    instance._dirty.clear()


class _SaveOfOneRow(Prepared):
    """`save_changes`' UPDATE of one row by its primary key: of the rows of its table
    kept for the turn, only that one is dropped."""

    def _tell_turn(self, model: Any, values: Values) -> None:
        commits.wrote(model, values[model._meta.primary_key.name])


def write_later(query: peewee.Query) -> None:
    """A peewee write query whose result is not read, sent as `Prepared.execute_later`
    sends: with the next statement, in a turn on PostgreSQL."""
    commits.wrote(getattr(query, "model", None))
    sql, params = query.sql()
    database.write_later(sql, params)
