"""``python -m kvwatch.daemon`` is ``kvwatch``."""

import sys

from kvwatch.daemon.entry import main

sys.exit(main())
