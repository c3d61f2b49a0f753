"""`python -m gguf_runtime` is the `gguf-run` command."""

import sys

from .cli.app import main

sys.exit(main())
