"""The engine's contracts are types that mypy holds (`make typecheck`, run first by `make
test` and so by CI, with mypy.ini): code that breaks one fails the check."""
import pathlib

from mypy import api

ROOT = pathlib.Path(__file__).resolve().parent.parent

BROKEN = '''
from engine import inbox, outbox
from engine.contracts import EngineContext
from models import Outbox


async def caller(ctx: EngineContext, row: Outbox) -> None:
    accepted = await inbox.accept(ctx, "card", "invoice.paid", "k-1", b"{}", external_id=7)
    print(accepted.event.id)
    print((await outbox.send(ctx, row)).ok)
    await ctx.commits.run("not a unit")
    outbox.Effects(ctx).job("deliver", {"order_number": "FO-1"}, purpose=1)
'''


def test_the_type_check_sees_each_broken_contract(tmp_path):
    caller = tmp_path / "caller.py"
    caller.write_text(BROKEN)
    report, _, status = api.run(["--config-file", str(ROOT / "mypy.ini"), str(caller)])
    errors = [line.split(": error: ", 1)[1] for line in report.splitlines()
              if ": error: " in line]

    assert status == 1
    assert errors == [
        # A call's fields are the inbox's (engine.inbox.CallFields).
        'Argument "external_id" to "accept" has incompatible type "int"; expected '
        '"str | None"  [arg-type]',
        # Accepted: the event is None when the call went to the spool.
        'Item "None" of "WebhookEvent | None" has no attribute "id"  [union-attr]',
        # SendOutcome: None when another sender took the row over.
        'Item "None" of "Result | None" has no attribute "ok"  [union-attr]',
        # A unit of work is a callable (engine.commits.Unit).
        'Argument 1 to "run" of "GroupCommit" has incompatible type "str"; expected '
        '"Callable[[], Never]"  [arg-type]',
        'Argument "purpose" to "job" of "Effects" has incompatible type "int"; expected '
        '"str | None"  [arg-type]',
    ]
