"""``python -m scale_cl.bench``: `scale-cl bench` without the ``scale-cl`` entry point."""

import sys

from scale_cl.cli.bench import main

sys.exit(main())
