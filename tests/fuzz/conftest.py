"""Fuzz targets (hypothesis).  Brief by default so ``make test`` stays quick; a longer run:

    EPP_FUZZ_EXAMPLES=200000 .venv/bin/python -m pytest -q tests/fuzz

(``EPP_FUZZ_EXAMPLES`` is the number of examples per target.)  Each target asserts the one
property that matters at a trust boundary: arbitrary input produces either a value or the
package's own error type, never another exception, a hang, or a crash of the process.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

EXAMPLES = int(os.environ.get("EPP_FUZZ_EXAMPLES", "300"))

settings.register_profile(
    "fuzz",
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=False,
)
