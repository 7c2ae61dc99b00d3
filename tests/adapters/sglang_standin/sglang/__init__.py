"""A test-only stand-in for the `sglang` package (SGLang itself needs CUDA): see `launch_server`."""
