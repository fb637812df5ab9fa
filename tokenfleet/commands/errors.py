"""The error every command may raise for a problem the user can fix."""


class CliError(Exception):
    """Printed as ``tokenfleet: message`` with exit status 2, without a traceback."""


def message_of(exc: BaseException) -> str:
    """``exc``'s text as a user should read it: ``str`` of a KeyError is the repr of its
    argument, so a registry's "unknown policy ..." came out between quotes."""
    if isinstance(exc, KeyError) and len(exc.args) == 1 and isinstance(exc.args[0], str):
        return exc.args[0]
    return str(exc)
