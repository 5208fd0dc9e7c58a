"""Small database helpers shared by the services."""
import peewee

from models import is_postgres

# Errors that mean "the database cannot be reached or written", not "this data is wrong".
UNAVAILABLE = (peewee.OperationalError, peewee.InterfaceError)


def why_unavailable(exc):
    """The driver's message on one log line (psycopg2's runs over several)."""
    return " ".join(str(exc).split())


def locked(query):
    """`query` with FOR UPDATE on PostgreSQL; SQLite serialises writers by itself."""
    return query.for_update() if is_postgres() else query
