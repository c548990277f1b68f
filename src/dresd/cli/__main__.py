"""`python -m dresd.cli ...` is `dresd ...`."""

import sys

from dresd.cli.main import main

sys.exit(main())
