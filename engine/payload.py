"""How a stored payload is read back."""
import decimal
import json


def exact_json(text):
    """JSON whose numbers keep every digit: 7.80 becomes Decimal("7.80"), never a float."""
    return json.loads(text, parse_float=decimal.Decimal, parse_constant=decimal.Decimal)
