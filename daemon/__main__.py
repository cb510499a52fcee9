"""``python -m kvwatch.daemon`` is ``kvwatch``."""

import sys

from kvwatch.daemon.cli import main

sys.exit(main())
