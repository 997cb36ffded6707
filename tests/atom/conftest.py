"""The ATOM suite runs against the pinned ATOM snapshot (ATOM is not on PyPI): it is unpacked
once per run and put on ``sys.path`` here and on ``PYTHONPATH`` for the engines' processes.
``KVLINK_ATOM_SNAPSHOT`` names the archive; by default it is the workplace's copy beside the
checkout (``../shared/third-party/atom-ffdf3bb5.tar.gz``)."""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import harness  # noqa: E402

sys.path.insert(0, harness.snapshot_root())

import stub  # noqa: E402,F401  (the aiter stub, before anything imports atom)


def pytest_report_header(config):
    return [f"ATOM snapshot {harness.SNAPSHOT_NAME} from {harness.snapshot_archive()}, unpacked to {harness.snapshot_root()}"]
