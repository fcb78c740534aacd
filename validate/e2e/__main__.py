"""``python -m validate.e2e [options]``: the end-to-end script wherever the kit is installed (inside
an image the file lives in site-packages). Options as in test_llama4_eagle_tp8.py's header.

SIGTERM (``docker stop``, a CI cancel reaching the container) is turned into KeyboardInterrupt, so
the script records the run as interrupted and shuts its engine's workers down, as on Ctrl-C; and
SIGINT is handled even where it was inherited as ignored (a job started in the background by a
non-interactive shell), so the host's forwarded Ctrl-C always reaches the script.
"""

import signal
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("test_llama4_eagle_tp8.py")


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.exit(pytest.main([str(SCRIPT), "-p", "no:cacheprovider", "-s", "-q", *sys.argv[1:]]))
