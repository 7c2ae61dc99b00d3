"""A user's own package: the rewards of the reverse-a-word task (examples/reverse_word)."""
