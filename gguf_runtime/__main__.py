"""`python -m gguf_runtime` is the `gguf-run` command."""

import sys

from .cli.app import main

if __name__ == "__main__":  # (not in the processes multiprocessing spawns: tensor-parallel ranks)
    sys.exit(main())
