"""`python -m dresd ...` is `dresd ...`."""

import sys

from dresd.cli.main import main

sys.exit(main())
