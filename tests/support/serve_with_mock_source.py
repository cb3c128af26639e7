"""``python -m tests.support.serve_with_mock_source serve ...``: the ``epp`` command with
llm-d-router's test-only ``mock-metrics-source`` accepted, the way upstream's integration harness
runs its EPP, so the integration configs that declare it can be served in tests."""

from __future__ import annotations

import sys

from epp.cli import main
from tests.support.mock_metrics_source import mock_metrics_source

if __name__ == "__main__":
    with mock_metrics_source():
        sys.exit(main())
