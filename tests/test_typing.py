"""The type checker holds a plugin to the transaction's methods: a card event type added
as docs/ARCHITECTURE.md says ("Adding a card event type") is checked by `make typecheck`,
and a wrong call in it is refused before it runs."""
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent

PLUGIN = '''"""charge.refund.updated: a refund's status changed; the order keeps a note of it."""
from typing import Any

from engine.contracts import EngineContext
from engine.transaction import Transaction
from plugins.card import EACH_EVENT
from plugins.registry import card_event


@card_event("charge.refund.updated", EACH_EVENT, background=True)
def handle(ctx: EngineContext, event: dict[str, Any], tx: Transaction) -> None:
    refund = event["data"]["object"]
    number = refund["metadata"]["order_id"]
    order = {lookup}
    if order is None:
        tx.retry_later(f"no formation order {{number}} yet")
        return
    order.append_note(f"Refund {{refund['id']}}: {{refund['status']}}")
    tx.save(order)
'''


def mypy_on(tmp_path: pathlib.Path, lookup: str) -> subprocess.CompletedProcess[str]:
    plugin = tmp_path / "charge_refund_updated.py"
    plugin.write_text(PLUGIN.format(lookup=lookup))
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "mypy.ini"),
         "--cache-dir", str(tmp_path / "cache"), str(plugin)],
        cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_a_new_card_plugin_that_calls_the_transaction_rightly_passes(tmp_path):
    checked = mypy_on(tmp_path, 'tx.lock_order("formation", number)')
    assert checked.returncode == 0, checked.stdout


def test_mypy_refuses_a_wrong_call_in_a_new_card_plugin(tmp_path):
    # The order's kind left out: the plugin would fail on its first event.
    checked = mypy_on(tmp_path, "tx.lock_order(number)")
    assert checked.returncode == 1
    assert 'No overload variant of "lock_order" of "OrderStore" matches argument type' in \
        checked.stdout


def test_mypy_refuses_an_untyped_plugin(tmp_path):
    plugin = tmp_path / "untyped.py"
    plugin.write_text("from plugins.registry import card_event\n\n\n"
                      "@card_event('charge.refund.updated')\n"
                      "def handle(ctx, event, tx):\n    tx.save(event)\n")
    checked = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "mypy.ini"),
         "--cache-dir", str(tmp_path / "cache"), str(plugin)],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert checked.returncode == 1
    assert "Function is missing a type annotation" in checked.stdout
