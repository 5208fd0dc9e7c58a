"""Small database helpers shared by the services."""
import peewee

from models import database, is_postgres

# Errors that mean "the database cannot be reached or written", not "this data is wrong".
UNAVAILABLE = (peewee.OperationalError, peewee.InterfaceError)


def why_unavailable(exc):
    """The driver's message on one log line (psycopg2's runs over several)."""
    return " ".join(str(exc).split())


def locked(query):
    """`query` with FOR UPDATE on PostgreSQL; SQLite serialises writers by itself."""
    return query.for_update() if is_postgres() else query


def insert_once(insert, **values):
    """Run `insert` (a services.prepared.PreparedInsert) unless a unique key already holds
    the row; return the new id or None.

    The insert runs in a savepoint, so a duplicate leaves an enclosing transaction
    usable; two racing inserts of the same key end with exactly one row."""
    try:
        with database.atomic():
            return insert.inserted_id(**values)
    except peewee.IntegrityError:
        return None
