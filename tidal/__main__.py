"""``python -m tidal`` is the ``tidal`` command."""

from tidal.cli import run

run()
