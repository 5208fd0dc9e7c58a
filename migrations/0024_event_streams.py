"""Each event's place in its sender's record (models.WebhookEvent.stream, version), and the
partial indexes the inbox's ordering rule reads, in place of the one by order number.

Events stored before it that are still unfinished are given the place their sender's
record gives a new one where the row says enough: a workflow webhook's stream is its
path's group and its order (`formation:FO-1`), a crypto callback's its invoice, a card
event none; their version is empty, which sorts before any other: they came before every event stored
since, and keep the order of their arrival among themselves."""
from peewee import SQL, TextField

from migrations import add_column_if_missing
from models import WebhookEvent, is_postgres


def apply(db, migrator):
    add_column_if_missing(db, migrator, "webhook_events", "stream", TextField(null=True))
    add_column_if_missing(db, migrator, "webhook_events", "version", TextField(null=True))
    db.execute_sql("DROP INDEX IF EXISTS webhook_events_unfinished_by_order")
    with db.bind_ctx([WebhookEvent]):
        unfinished = WebhookEvent.status.in_(["received", "failed"])
        group = SQL("split_part(event_type, '/', 1)" if is_postgres(db)
                    else "substr(event_type, 1, instr(event_type, '/') - 1)")
        (WebhookEvent.update(stream=group.concat(":").concat(WebhookEvent.order_number))
         .where(unfinished, WebhookEvent.source == "workflow",
                WebhookEvent.order_number.is_null(False), WebhookEvent.stream.is_null())
         .execute())
        (WebhookEvent.update(stream=SQL("'invoice:'").concat(WebhookEvent.order_number))
         .where(unfinished, WebhookEvent.source == "crypto",
                WebhookEvent.order_number.is_null(False), WebhookEvent.stream.is_null())
         .execute())
        (WebhookEvent.update(version="")
         .where(unfinished, WebhookEvent.stream.is_null(False), WebhookEvent.version.is_null())
         .execute())
        db.create_tables([WebhookEvent], safe=True)
