"""One way to validate, for every module (the rule of notebook 02_data on: a bad input stops with a
clear error)."""


def require(ok: bool, message: str, error: type[Exception] = ValueError) -> None:
    """Raise `error(message)` unless `ok`; the message names the value, what it is and what it must
    be."""
    if not ok:
        raise error(message)
