"""Test stand-in for `python -m sglang.launch_server`: the flags tidal's launcher passes, mapped
onto `tidal serve` (tidal's engine behind SGLang's protocol). Any other flag is an error, as an
unknown flag is for SGLang (argparse exits with code 2). `--standin-hang` never answers /health
(a server stuck loading)."""

from __future__ import annotations

import argparse
import time


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="sglang.launch_server")
    p.add_argument("--model-path", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    p.add_argument("--random-seed", type=int, default=0)
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--weight-version", default="default")
    p.add_argument("--skip-server-warmup", action="store_true")
    p.add_argument("--api-key")
    p.add_argument("--standin-hang", action="store_true")
    args = p.parse_args(argv)
    if args.tp_size != 1:
        p.error("--tp-size: the stand-in serves one rank")
    if args.standin_hang:
        while True:
            time.sleep(60)

    from transformers import AutoTokenizer

    from tidal.engine.llm_engine import LLMEngine
    from tidal.server.app import serve
    from tidal.server.options import ServerConfig

    def core(model_dir: str, **options):
        engine = LLMEngine(model_dir, AutoTokenizer.from_pretrained(model_dir), **options)
        engine.weight_version = int(args.weight_version) if args.weight_version.isdigit() else 0
        return engine

    config = ServerConfig(api_key=args.api_key)
    serve(
        args.model_path,
        args.host,
        args.port,
        config=config,
        core_factory=core,
        log_level="warning",
        dtype=args.dtype,
        kv_cache_tokens=4096,
    )


if __name__ == "__main__":
    main()
