"""The console's sessions, kept on the server so that they can be ended (logout, a new
password, `receiver.py console logout-all`); 0011 creates the table on a database that
never had it."""
from models import ConsoleSession


def apply(db, migrator):
    with db.bind_ctx([ConsoleSession]):
        db.create_tables([ConsoleSession], safe=True)
