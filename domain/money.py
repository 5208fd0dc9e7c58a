"""Amounts as text that always names their currency: '$499.00' is said of US dollars
only; any other currency is named by its code ('CAD 499.00', 'JPY 5000')."""
import decimal

# Stripe's zero-decimal and three-decimal currencies (docs.stripe.com/currencies): its
# integer amounts are in units of these, or in thousandths; in hundredths of the others.
ZERO_DECIMAL = frozenset("bif clp djf gnf jpy kmf krw mga pyg rwf ugx vnd vuv xaf xof xpf"
                         .split())
THREE_DECIMAL = frozenset("bhd jod kwd omr tnd".split())


def decimal_places(currency: str) -> int:
    code = currency.lower()
    return 0 if code in ZERO_DECIMAL else 3 if code in THREE_DECIMAL else 2


def money(minor_units: int | None, currency: str | None, places: int | None = None) -> str:
    """An integer amount in the currency's minor units (`places` decimals: by default the
    currency's own, as Stripe counts them) as text: '$499.00' for USD, 'CAD 499.00'
    otherwise. Without a currency the amount is not taken for dollars:
    '499.00 (currency not given)'."""
    code = (currency or "").strip().upper()
    if places is None:
        places = decimal_places(code) if code else 2
    amount = decimal.Decimal(int(minor_units or 0)).scaleb(-places).quantize(
        decimal.Decimal(1).scaleb(-places))
    if code == "USD":
        return f"${amount}"
    if not code:
        return f"{amount} (currency not given)"
    return f"{code} {amount}"
