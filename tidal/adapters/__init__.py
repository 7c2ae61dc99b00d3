"""Engines that are not tidal's own, behind tidal's engine contract (`tidal.contracts.Engine`):
`AsyncEngine` (any step-based core on a thread of its own), vLLM's in-process core, the transformers
engine, HTTP clients and the router for `tidal serve` and SGLang servers, SGLang's launcher, and the
factory that builds the one `engine.kind` names (`tidal.backends`)."""
