"""`python -m quantmesh ...` and `torchrun ... -m quantmesh ...`: the `quantmesh` command."""

from .cli.main import run

if __name__ == "__main__":
    run()
