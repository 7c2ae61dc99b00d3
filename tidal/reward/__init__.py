"""Rewards: the built-in verifiers, user reward functions (per sample or per group) called under
limits, the LLM judge, the code-tests reward and the sandbox that runs model-written code."""
