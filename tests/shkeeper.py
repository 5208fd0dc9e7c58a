"""Callbacks shaped like SHKeeper's real ones (shkeeper/callback.py): amounts as strings
rounded as SHKeeper rounds them, the whole invoice in every callback with the triggering
transaction marked, fee_percent and overpaid_fiat; and its signature headers."""
import hashlib
import hmac
import json

API_KEY = "shk-test-api-key-0123456789"
URL = "/api/v1/webhooks/crypto-processor"


def transaction(txid, amount_crypto, amount_fiat, trigger=False, crypto="BTC",
                date="2026-11-20 09:00:00"):
    return {"txid": txid, "date": date, "amount_crypto": amount_crypto,
            "amount_fiat": amount_fiat, "trigger": trigger, "crypto": crypto}


def invoice(external_id, status, transactions, balance_crypto, balance_fiat, crypto="BTC",
            fiat="USD", overpaid_fiat="0.00", **changes):
    """An invoice callback; `paid` follows the status as SHKeeper sets it."""
    return {
        "external_id": external_id,
        "crypto": crypto,
        "addr": "bc1qxy2kgdygjrsqtzq2n0yrf2493p83kkfjhx0wlh",
        "fiat": fiat,
        "balance_fiat": balance_fiat,
        "balance_crypto": balance_crypto,
        "paid": status in ("PAID", "OVERPAID"),
        "status": status,
        "transactions": transactions,
        "fee_percent": "2",
        "overpaid_fiat": overpaid_fiat,
        **changes,
    }


def paid(external_id, txid="tx-paid-1", balance_crypto="0.00012345", balance_fiat="7.80",
         **changes):
    """A one-transaction invoice, fully paid."""
    tx = transaction(txid, balance_crypto, balance_fiat, trigger=True)
    return invoice(external_id, "PAID", [tx], balance_crypto, balance_fiat, **changes)


def paid_in_steps(external_id):
    """One invoice paid in three transactions: PARTIAL, then PAID, then OVERPAID; each
    callback carries every transaction so far, the newest marked as the trigger."""
    first = transaction("tx-step-1", "0.00005000", "3.16", date="2026-11-20 09:00:00")
    second = transaction("tx-step-2", "0.00007345", "4.64", date="2026-11-20 09:20:00")
    third = transaction("tx-step-3", "0.00001000", "0.63", date="2026-11-20 09:40:00")
    return [
        invoice(external_id, "PARTIAL", [{**first, "trigger": True}], "0.00005000", "3.16"),
        invoice(external_id, "PAID", [first, {**second, "trigger": True}],
                "0.00012345", "7.80"),
        invoice(external_id, "OVERPAID", [first, second, {**third, "trigger": True}],
                "0.00013345", "8.43", overpaid_fiat="0.63"),
    ]


def unconfirmed(external_id, txid="tx-unconfirmed-1", amount="0.00012345", crypto="BTC"):
    """The notice SHKeeper sends when it first sees a transaction, before confirmations."""
    return {"status": "unconfirmed", "external_id": external_id, "crypto": crypto,
            "addr": "bc1qxy2kgdygjrsqtzq2n0yrf2493p83kkfjhx0wlh", "txid": txid,
            "amount": amount}


def encode(callback):
    """The body as SHKeeper's signing code serialises it: compact, keys sorted."""
    return json.dumps(callback, separators=(",", ":"), sort_keys=True).encode("utf-8")


def key_headers(api_key=API_KEY, header="X-Shkeeper-Api-Key"):
    return {header: api_key, "Content-Type": "application/json"}


def signed_headers(raw, timestamp, api_key=API_KEY, with_key=True):
    """The headers of a newer SHKeeper: the signature, and the legacy key header too."""
    signature = hmac.new(api_key.encode(), f"{timestamp}.".encode() + raw,
                         hashlib.sha256).hexdigest()
    headers = {"X-Shkeeper-Timestamp": str(timestamp), "X-Shkeeper-Signature": signature,
               "Content-Type": "application/json"}
    return {**headers, "X-Shkeeper-Api-Key": api_key} if with_key else headers
