"""Ray cluster start/join, placement groups and actor groups."""
