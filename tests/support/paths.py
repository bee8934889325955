"""The repository root, for tests, fixtures and support code that run commands from it or read its files."""
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
