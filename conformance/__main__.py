"""``python -m conformance``: the harness's command line (``conformance.orchestrate.cli``)."""

import sys

from conformance.orchestrate.cli import main

sys.exit(main())
