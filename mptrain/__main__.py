"""``python -m mptrain``: the same program as the ``mptrain`` console script (torchrun launches it this way)."""
import sys

from mptrain.cli import main

sys.exit(main())
