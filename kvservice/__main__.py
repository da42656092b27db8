"""`python -m kvservice` is the `kvservice` command."""

import sys

from kvservice.cli import main

sys.exit(main())
