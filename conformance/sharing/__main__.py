"""``python -m conformance.sharing``: run the sharing scenario and write its report."""

import sys

from conformance.sharing.report import main

sys.exit(main())
