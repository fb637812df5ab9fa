"""The error every command may raise for a problem the user can fix."""


class CliError(Exception):
    """Printed as ``tokenfleet: message`` with exit status 2, without a traceback."""
