"""``python -m scale_cl.bench``: `scale-cl bench` without the ``scale-cl`` entry point."""

import sys

from scale_cl.bench.cli import main

sys.exit(main())
