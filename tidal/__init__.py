"""tidal: reinforcement-learning post-training for language models, from a laptop to a cluster."""

__version__ = "0.1.0"
