"""Reward functions loaded by path in end-to-end tests (through --custom-rm-path, as a user would).

``parity`` depends on the sampled response only, so every GRPO group of a few samples almost surely
has rewards that differ: the loop always has a gradient, whatever the random policy answers.
"""


def parity(prompt, response, label):
    return float(sum(map(ord, response)) % 2)
