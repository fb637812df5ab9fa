"""``tokenfleet`` and ``python -m tokenfleet``: the command line. Its modules take over a
second to import (the CLI's, then the commands' as its parser is built), and Ctrl-C in
that time is answered as anywhere later, not with Python's traceback
(``tokenfleet.cli.main`` itself cannot catch what interrupts its imports or its parser)."""

import importlib
import sys

from tokenfleet.commands.errors import interrupted


def run() -> int:
    try:  # by name: mypy --strict checks this module, not yet the commands it imports
        cli = importlib.import_module("tokenfleet.cli")
        code: int = cli.main()
    except KeyboardInterrupt:  # past the parser, main answers it itself
        return interrupted()
    return code


if __name__ == "__main__":
    sys.exit(run())
