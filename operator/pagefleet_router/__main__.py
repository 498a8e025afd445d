"""`python -m pagefleet_router [flags]`: the router without the `pagefleet` console script,
which imports the serving package and with it torch."""

import sys

from .cli import main

sys.exit(main())
