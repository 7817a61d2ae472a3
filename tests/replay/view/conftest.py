"""Shared by the viewer's tests: the hand-written logs of tests/replay/builders.py."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
