"""`python -m quantmesh ...` and `torchrun ... -m quantmesh ...`: the `quantmesh` command."""

import sys

from .cli.main import main

if __name__ == "__main__":
    sys.exit(main())
