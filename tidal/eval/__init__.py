"""Evaluation: held-out sets scored with the rollout engine (`evaluate`: pass@k, mean reward) during
training (`eval.interval`) or on a checkpoint (`tidal eval`); their options (`options`)."""
