"""tidal: colocated RL post-training for language models.

A trainer (FSDP2 over Hugging Face models) and rollout engines run as Ray actors and take turns on
the same devices; between phases each side pauses its memory, and after every training step the new
weights are synced from trainer to engines. See README.md for the two commands that run it.
"""

__version__ = "0.1.0"
