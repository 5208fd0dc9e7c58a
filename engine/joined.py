"""Several statements that each return rows, run as one statement: one round trip where
each would be one (engine.commits.Ahead). PostgreSQL only: SQLite takes no write in a
WITH, and an embedded database has no round trip to save.

psycopg2 sends several statements in one string, but keeps only the last one's rows;
so the statements become the parts of one WITH, and its main query a UNION ALL of one
branch per part, which returns every part's rows.

What this rests on is what PostgreSQL documents, and no more ("WITH Queries (Common
Table Expressions)", its section "Data-Modifying Statements in WITH"): the parts run
concurrently with each other and with the main query, in an order it does not say, all
with one snapshot, so that none sees the rows another writes; a part that writes runs to
completion whether or not its rows are read; a select part runs as far as the main query
reads it, and the main query reads every row of every part (each branch is one part's
rows, and a UNION ALL returns every row of each). Its rows are then each part's as if
it ran alone at the statement's start (a select's FOR UPDATE locks the rows it returns:
SELECT's "The Locking Clause"), whatever the order in which the server ran them. So the
caller asks only for parts that

- do not read a table another part writes (they would not see those writes), and
- may take their locks in any order: locks the parts take in an order another process's
  statement takes the other way round end in a deadlock, which the server finds and ends
  with SQLSTATE 40P01 ("Deadlocks" in "Explicit Locking"), or in a wait past
  lock_timeout (55P03): both are conflicts (engine.errors.is_conflict), and the group
  commit runs the turn's units again (engine.commits).
"""
from typing import Any, Protocol, Sequence

# A statement as the driver takes it: its SQL and its bound values.
Statement = tuple[str, Sequence[Any]]
# What a statement returned: its column names and its rows.
Returned = tuple[list[str], list[tuple[Any, ...]]]


class Executes(Protocol):
    def execute_sql(self, sql: str, params: Any = None) -> Any: ...


def rows_of_each(db: Executes, statements: Sequence[Statement]) -> list[Returned]:
    """Each statement's (column names, rows), of statements that each return rows (a
    select, or a write with RETURNING), run as one statement on `db` (above).

    A branch of the UNION ALL holds its part's columns beside the other parts', NULL (an
    outer join to the other parts with WHERE false, which reads none of their rows,
    gives those NULLs their columns' types); the part's `found_<n>` column, never NULL
    in its rows, tells which part a row is of."""
    if len(statements) == 1:
        cursor = db.execute_sql(*statements[0])
        return [([column[0] for column in cursor.description], cursor.fetchall())]
    parts = range(len(statements))

    def branch(n: int) -> str:
        others = " ".join(f"LEFT JOIN (SELECT 1 AS found_{other}, * FROM part_{other} "
                          f"WHERE false) AS rows_{other} ON true"
                          for other in parts if other != n)
        return (f"SELECT {', '.join(f'rows_{part}.*' for part in parts)} "
                f"FROM (SELECT 1 AS found_{n}, * FROM part_{n}) AS rows_{n} {others}")
    sql = "".join((
        "WITH ", ", ".join(f"part_{n} AS ({statements[n][0]})" for n in parts), " ",
        " UNION ALL ".join(branch(n) for n in parts)))
    cursor = db.execute_sql(sql, [param for _, params in statements for param in params])
    names = [column[0] for column in cursor.description]
    starts = [names.index(f"found_{n}") for n in parts] + [len(names)]
    rows = cursor.fetchall()
    return [(names[starts[n] + 1:starts[n + 1]],
             [row[starts[n] + 1:starts[n + 1]] for row in rows
              if row[starts[n]] is not None])
            for n in parts]
