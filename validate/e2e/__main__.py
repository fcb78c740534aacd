"""``python -m validate.e2e [options]``: the end-to-end script wherever the kit is installed (inside
an image the file lives in site-packages). Options as in test_llama4_eagle_tp8.py's header."""

import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("test_llama4_eagle_tp8.py")

if __name__ == "__main__":
    sys.exit(pytest.main([str(SCRIPT), "-p", "no:cacheprovider", "-s", "-q", *sys.argv[1:]]))
