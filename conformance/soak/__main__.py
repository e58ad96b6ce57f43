"""``python -m conformance.soak``: run the churn soak and write its report."""

import sys

from conformance.soak.report import main

sys.exit(main())
