"""How a JSON body is read: the same way when the call comes in and when its stored copy
is handled again (a retry, a replay), so that what was accepted can always be handled."""
import decimal
import json
from typing import Any

BYTE_ORDER_MARK = "\ufeff"


def read_json(data: bytes | bytearray | str, exact: bool = False) -> Any:
    """`data` (a call's raw bytes, or the text it was stored as) as JSON; ValueError when
    it is not.

    A leading UTF-8 byte-order mark is skipped, as most JSON parsers do: some senders'
    tools write one, and the bytes are stored with it. Only UTF-8 is read (JSON between
    systems is UTF-8), so the stored text is the text that was parsed. A document nested
    deeper than the parser can follow is refused like any other unreadable body. With
    `exact`, numbers keep every digit: 7.80 is Decimal("7.80"), never a float."""
    if isinstance(data, (bytes, bytearray)):
        data = bytes(data).decode("utf-8")
    data = data.removeprefix(BYTE_ORDER_MARK)
    try:
        if exact:
            return json.loads(data, parse_float=decimal.Decimal,
                              parse_constant=decimal.Decimal)
        return json.loads(data)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def exact_json(data: bytes | bytearray | str) -> Any:
    """read_json keeping every digit of every number."""
    return read_json(data, exact=True)
