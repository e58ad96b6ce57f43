"""``python -m conformance.engine JOB.json PROGRESS_FD``: one engine process (see ``worker``)."""

import sys

from conformance.engine.worker import main

sys.exit(main(sys.argv[1:]))
