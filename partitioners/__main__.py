"""``python -m partitioners``: the ``pipe-balance`` command."""

import sys

from partitioners.cli import main

sys.exit(main())
