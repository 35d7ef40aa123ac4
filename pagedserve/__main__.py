"""``python -m pagedserve``: the ``pagedserve`` command, for an interpreter without the console
script on its PATH (the test suite and the benchmarks start their servers this way)."""

import sys

from pagedserve.entrypoints.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
