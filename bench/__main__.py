"""python -m bench <name> [options]: run one benchmark (see docs/performance.md)."""

import importlib
import sys

BENCHES = (
    "engine",
    "train_throughput",
    "scaling",
    "grpo_step",
    "learning",
    "profile_train",
    "overlap",
    "no_barrier",
    "lora",
    "routing_replay",
    "decode",
    "reward_model",
    "sampling",
    "gpu",
    "memory",
    "state_snapshots",
    "model_parallel",
    "host_step",
    "decode_check",
    "weight_push",
)


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in BENCHES:
        sys.exit(f"usage: python -m bench {{{'|'.join(BENCHES)}}} [options]")
    name = sys.argv.pop(1)
    importlib.import_module(f"bench.{name}").main()


if __name__ == "__main__":
    main()
