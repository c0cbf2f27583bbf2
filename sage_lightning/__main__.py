"""``python -m sage_lightning``: what will run here, for a bug report (:mod:`sage_lightning.report`)."""

import sys

from sage_lightning.report import main

sys.exit(main())
