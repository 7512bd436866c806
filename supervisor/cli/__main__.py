"""`python -m supervisor.cli`: the `rlsup` command."""

import sys

from supervisor.cli.main import main

sys.exit(main())
