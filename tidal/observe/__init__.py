"""Run directory, console display and plots."""
