"""``python -m partitioners``: the ``pipe-balance`` command."""

import sys

from partitioners.cli.command import main

sys.exit(main())
