"""``python -m slow_steps SECONDS ARGS...`` runs ``python -m tidal ARGS`` with every decode step of the embedded
engine ``SECONDS`` longer (a sleep before each ``GraphSet.run``, the one call each step makes on any device).

For tests that act while a request is still generating (a pause, a request joining a running step): the tiny
preset decodes a row in ~0.7 ms a token on an idle core, so its longest request (250 tokens, the preset's 256
positions) can end before a poll of the server sees it running. Slowed, it outlasts them on any host.
"""

from __future__ import annotations

import runpy
import sys
import time

from tidal.rollout.fast.graphs import GraphSet

delay = float(sys.argv[1])
run = GraphSet.run


def slow_run(self, *args, **kwargs):
    time.sleep(delay)
    return run(self, *args, **kwargs)


GraphSet.run = slow_run
sys.argv = ["tidal", *sys.argv[2:]]
runpy.run_module("tidal", run_name="__main__", alter_sys=True)
