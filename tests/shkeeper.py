"""Callbacks shaped like SHKeeper's real ones (shkeeper/callback.py): amounts as strings
written as SHKeeper writes them, the whole invoice in every callback with the triggering
transaction marked, each transaction's fee split out, the fee policy and overpaid_fiat
(two decimals); the body as it signs it, and its signature headers."""
import decimal
import hashlib
import hmac
import json

API_KEY = "shk-test-api-key-0123456789"
URL = "/api/v1/webhooks/crypto-processor"


def shown(amount):
    """An amount as SHKeeper writes it (its `remove_exponent`): no exponent, no trailing
    zeros, a whole number without a point; at most 10 decimals, as it stores them."""
    number = decimal.Decimal(amount).quantize(decimal.Decimal("1e-10")).normalize()
    return str(number.quantize(decimal.Decimal(1)) if number == number.to_integral()
               else number)


def transaction(txid, amount_crypto, amount_fiat, trigger=False, crypto="BTC",
                date="2026-11-20 09:00:00", fee_percent="2"):
    """One transaction as every callback lists it: its fiat amount includes SHKeeper's
    fee, split out as amount_fiat_without_fee and fee_fiat."""
    fiat = decimal.Decimal(amount_fiat)
    without_fee = (fiat / (1 + decimal.Decimal(fee_percent) / 100)).quantize(
        decimal.Decimal("1e-10"))
    return {"txid": txid, "date": date, "amount_crypto": shown(amount_crypto),
            "amount_fiat": shown(fiat), "amount_fiat_without_fee": shown(without_fee),
            "fee_fiat": shown(fiat - without_fee), "trigger": trigger, "crypto": crypto}


def invoice(external_id, status, transactions, balance_crypto, balance_fiat, crypto="BTC",
            fiat="USD", overpaid_fiat="0.00", **changes):
    """An invoice callback; `paid` follows the status as SHKeeper sets it."""
    return {
        "external_id": external_id,
        "crypto": crypto,
        "addr": "bc1qxy2kgdygjrsqtzq2n0yrf2493p83kkfjhx0wlh",
        "fiat": fiat,
        "balance_fiat": shown(balance_fiat),
        "balance_crypto": shown(balance_crypto),
        "paid": status in ("PAID", "OVERPAID"),
        "status": status,
        "transactions": transactions,
        "fee_percent": "2",
        "fee_fixed": "0",
        "fee_policy": "PERCENT_FEE",
        "overpaid_fiat": overpaid_fiat,
        **changes,
    }


def paid(external_id, txid="tx-paid-1", balance_crypto="0.00012345", balance_fiat="7.80",
         **changes):
    """A one-transaction invoice, fully paid."""
    tx = transaction(txid, balance_crypto, balance_fiat, trigger=True,
                     crypto=changes.get("crypto", "BTC"))
    return invoice(external_id, "PAID", [tx], balance_crypto, balance_fiat, **changes)


def paid_in_steps(external_id):
    """One invoice (320 USD at 96 000 USD/BTC, 2 % fee: 0.0034 BTC quoted) paid in three
    transactions, as SHKeeper reports it: PARTIAL 0.001, then PAID +0.0024, then OVERPAID
    +0.0005. Each callback lists every transaction so far, oldest first, the one that
    caused it marked as trigger; overpaid_fiat is measured against 105 % of the invoice."""
    first = transaction("tx-step-1", "0.001", "96", date="2026-11-20 09:00:12")
    second = transaction("tx-step-2", "0.0024", "230.4", date="2026-11-20 09:41:37")
    third = transaction("tx-step-3", "0.0005", "48", date="2026-11-20 10:15:04")
    return [
        invoice(external_id, "PARTIAL", [{**first, "trigger": True}], "0.001", "96"),
        invoice(external_id, "PAID", [first, {**second, "trigger": True}], "0.0034", "326.4"),
        invoice(external_id, "OVERPAID", [first, second, {**third, "trigger": True}],
                "0.0039", "374.4", overpaid_fiat="38.40"),
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


# One invoice (CA-0042: 320 USD at 96 000 USD/BTC, 2 % fee) paid in three transactions, as
# SHKeeper v2.5.16+ puts it on the wire: (timestamp, signature, body) of each callback,
# signed with WIRE_API_KEY. The bytes follow its send_notification and compact_json_bytes.
WIRE_API_KEY = "nApijGv8djih7ozY"
WIRE = [
    (1795683612, "85ed1bbe5aeb464fe05c47538f015dba802c4026345b55553c26066a030dda86",
     b'{"addr":"bc1qar0srrr7xfkvy5l643lydnw9re59gtzzwf5mdq","balance_crypto":"0.001",'
     b'"balance_fiat":"96","crypto":"BTC","external_id":"CA-0042","fee_fixed":"0","fe'
     b'e_percent":"2","fee_policy":"PERCENT_FEE","fiat":"USD","overpaid_fiat":"0.00",'
     b'"paid":false,"status":"PARTIAL","transactions":[{"amount_crypto":"0.001","amou'
     b'nt_fiat":"96","amount_fiat_without_fee":"94.1176470588","crypto":"BTC","date":'
     b'"2026-11-20 09:00:12","fee_fiat":"1.8823529412","trigger":true,"txid":"a1f3c9e'
     b'27b1d4e0f9c8b7a6d5e4f3a2b1c0d9e8f7a6b5c4d3e2f1a0b9c8d7e6f"}]}'),
    (1795686097, "e955670e0b72b14ac9dccf3d184f1cb13955d56d6ab65325c6c002b870308d82",
     b'{"addr":"bc1qar0srrr7xfkvy5l643lydnw9re59gtzzwf5mdq","balance_crypto":"0.0034"'
     b',"balance_fiat":"326.4","crypto":"BTC","external_id":"CA-0042","fee_fixed":"0"'
     b',"fee_percent":"2","fee_policy":"PERCENT_FEE","fiat":"USD","overpaid_fiat":"0.'
     b'00","paid":true,"status":"PAID","transactions":[{"amount_crypto":"0.001","amou'
     b'nt_fiat":"96","amount_fiat_without_fee":"94.1176470588","crypto":"BTC","date":'
     b'"2026-11-20 09:00:12","fee_fiat":"1.8823529412","trigger":false,"txid":"a1f3c9'
     b'e27b1d4e0f9c8b7a6d5e4f3a2b1c0d9e8f7a6b5c4d3e2f1a0b9c8d7e6f"},{"amount_crypto":'
     b'"0.0024","amount_fiat":"230.4","amount_fiat_without_fee":"225.8823529412","cry'
     b'pto":"BTC","date":"2026-11-20 09:41:37","fee_fiat":"4.5176470588","trigger":tr'
     b'ue,"txid":"b2e4d0f38c2e5f1a0d9c8b7e6f5a4b3c2d1e0f9a8b7c6d5e4f3a2b1c0d9e8f7a"}]'
     b'}'),
    (1795688104, "b6c8381353b596533076e3903be31a751bf4d6b460b851e609fa388167b9889f",
     b'{"addr":"bc1qar0srrr7xfkvy5l643lydnw9re59gtzzwf5mdq","balance_crypto":"0.0039"'
     b',"balance_fiat":"374.4","crypto":"BTC","external_id":"CA-0042","fee_fixed":"0"'
     b',"fee_percent":"2","fee_policy":"PERCENT_FEE","fiat":"USD","overpaid_fiat":"38'
     b'.40","paid":true,"status":"OVERPAID","transactions":[{"amount_crypto":"0.001",'
     b'"amount_fiat":"96","amount_fiat_without_fee":"94.1176470588","crypto":"BTC","d'
     b'ate":"2026-11-20 09:00:12","fee_fiat":"1.8823529412","trigger":false,"txid":"a'
     b'1f3c9e27b1d4e0f9c8b7a6d5e4f3a2b1c0d9e8f7a6b5c4d3e2f1a0b9c8d7e6f"},{"amount_cry'
     b'pto":"0.0024","amount_fiat":"230.4","amount_fiat_without_fee":"225.8823529412"'
     b',"crypto":"BTC","date":"2026-11-20 09:41:37","fee_fiat":"4.5176470588","trigge'
     b'r":false,"txid":"b2e4d0f38c2e5f1a0d9c8b7e6f5a4b3c2d1e0f9a8b7c6d5e4f3a2b1c0d9e8'
     b'f7a"},{"amount_crypto":"0.0005","amount_fiat":"48","amount_fiat_without_fee":"'
     b'47.0588235294","crypto":"BTC","date":"2026-11-20 10:15:04","fee_fiat":"0.94117'
     b'64706","trigger":true,"txid":"c3f5e1a49d3f6a2b1e0d9c8f7a6b5c4d3e2f1a0b9c8d7e6f'
     b'5a4b3c2d1e0f9a8b"}]}'),
]


def told_amount(alerts):
    """The amount the last of an order's alerts tells its payment is: the order alert's
    `Amount:` line, or a later alert's `is now <amount>,`."""
    last = alerts[-1]
    if " is now " in last:
        return last.split(" is now ", 1)[1].split(",", 1)[0]
    [line] = [line for line in last.splitlines() if line.startswith("Amount: ")]
    return line.removeprefix("Amount: ").split(" ", 1)[0]
