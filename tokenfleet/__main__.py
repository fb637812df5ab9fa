"""``tokenfleet`` and ``python -m tokenfleet``: the command line. Its modules take about a
second to import, and Ctrl-C in that second is answered as anywhere later, not with
Python's traceback (``tokenfleet.cli`` itself cannot catch what interrupts its imports)."""

import importlib
import sys

from tokenfleet.commands.errors import interrupted


def run() -> int:
    try:  # by name: mypy --strict checks this module, not yet the commands it imports
        cli = importlib.import_module("tokenfleet.cli")
    except KeyboardInterrupt:
        return interrupted()
    code: int = cli.main()
    return code


if __name__ == "__main__":
    sys.exit(run())
