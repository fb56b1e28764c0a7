"""Reward functions loaded by path in end-to-end tests (through --custom-rm-path, as a user would).

``parity`` depends on the sampled response only, so every GRPO group of a few samples almost surely
has rewards that differ: the loop always has a gradient, whatever the random policy answers.
"""


def parity(prompt, response, label):
    return float(sum(map(ord, response)) % 2)


def first_char_eighth(prompt, response, label):
    """1 when the response's first character code is a multiple of 8 (about one sample in eight): a group of
    eight is all-zero about a third of the time, so dynamic sampling has groups to filter and groups to keep."""
    return float(bool(response) and ord(response[0]) % 8 == 0)


def nothing(prompt, response, label):
    """0 for every response: with dynamic sampling every group has zero variance and none is trained."""
    return 0.0
