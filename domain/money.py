"""Money: an integer amount in the minor unit of its currency, the currency beside it.

One unit per currency, for card and crypto alike: the minor unit ISO 4217 gives it (the
`iso4217` package carries ISO's own table: 2 decimals for USD and HUF, none for JPY,
three for KWD). Stripe counts amounts in those units too, but for its documented special
cases (`STRIPE_DECIMALS`), which `Money.of_stripe` turns into ISO's.

As text an amount always names its currency: '$499.00' is said of US dollars only; any
other currency is named by its code ('CAD 499.00', 'JPY 5000', 'KWD 1.234').
"""
import dataclasses
import decimal
import functools

import iso4217

# Where Stripe's integer amounts are not in ISO 4217's minor unit
# (docs.stripe.com/currencies#special-cases): ISK stays two-decimal in Stripe's API (100
# is one krona) though ISO gives it none; Stripe counts MGA in whole ariary though ISO
# gives it two decimals.
STRIPE_DECIMALS = {"ISK": 2, "MGA": 0}
# A currency ISO does not list (a code we were sent wrongly, or none at all) is read in
# hundredths, as most currencies are, and named as given.
UNLISTED_DECIMALS = 2


@functools.cache
def decimal_places(currency: str) -> int:
    """The number of decimals of the currency's minor unit (ISO 4217)."""
    try:
        exponent = iso4217.Currency(currency.strip().upper()).exponent
    except ValueError:
        return UNLISTED_DECIMALS
    # Gold, funds codes and the like have no minor unit; none of ours is one.
    return UNLISTED_DECIMALS if exponent is None else exponent


def _code(currency: str | None) -> str:
    return (currency or "").strip().upper()


def minor_units(amount: decimal.Decimal, currency: str | None) -> int:
    """`amount` (in whole units of the currency) in its minor unit, rounded half up:
    ¥48,959.975 is 48960, KWD 1.2345 is 1235 (thousandths), $7.805 is 781."""
    places = decimal_places(_code(currency))
    # Wide enough for every digit an accepted amount may have: in the default 28-digit
    # context the scaling would round once before the rounding to the minor unit.
    with decimal.localcontext(prec=100):
        return int(amount.scaleb(places).quantize(decimal.Decimal(1),
                                                  rounding=decimal.ROUND_HALF_UP))


@dataclasses.dataclass(frozen=True)
class Money:
    """`minor` units of `currency` (upper-case ISO code; empty when not given)."""

    minor: int
    currency: str

    @classmethod
    def of(cls, minor: int | None, currency: str | None) -> "Money":
        return cls(int(minor or 0), _code(currency))

    @classmethod
    def of_stripe(cls, amount: int | None, currency: str | None) -> "Money":
        """An amount as Stripe's API gives it (its integer in Stripe's unit for the
        currency), in the currency's ISO minor unit."""
        code = _code(currency)
        shift = decimal_places(code) - STRIPE_DECIMALS.get(code, decimal_places(code))
        if shift == 0:
            return cls(int(amount or 0), code)
        return cls(minor_units(decimal.Decimal(int(amount or 0)).scaleb(
            -STRIPE_DECIMALS[code]), code), code)

    @classmethod
    def of_decimal(cls, amount: decimal.Decimal, currency: str | None) -> "Money":
        return cls(minor_units(amount, currency), _code(currency))

    @property
    def amount(self) -> decimal.Decimal:
        """In whole units of the currency, every decimal of its minor unit shown."""
        places = decimal_places(self.currency)
        return decimal.Decimal(self.minor).scaleb(-places).quantize(
            decimal.Decimal(1).scaleb(-places))

    def __str__(self) -> str:
        if self.currency == "USD":
            return f"${self.amount}"
        if not self.currency:
            return f"{self.amount} (currency not given)"
        return f"{self.currency} {self.amount}"


def money(minor: int | None, currency: str | None) -> str:
    """An integer amount in the currency's minor unit as text: '$499.00' for USD,
    'CAD 499.00' otherwise; without a currency the amount is not taken for dollars:
    '499.00 (currency not given)'."""
    return str(Money.of(minor, currency))


def stripe_money(amount: int | None, currency: str | None) -> str:
    """An amount as Stripe's API gives it, as text (`Money.of_stripe`)."""
    return str(Money.of_stripe(amount, currency))
