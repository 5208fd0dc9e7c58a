"""Tables of the public endpoints: self-filing records, survey responses, referral codes."""
from models import PUBLIC_MODELS


def apply(db, migrator):
    with db.bind_ctx(PUBLIC_MODELS):
        db.create_tables(PUBLIC_MODELS, safe=True)
