"""Rollout engine benchmark: the GRPO workload on tidal's engine vs vLLM vs transformers' `generate`.

    python -m bench engine                          # 16 prompts x 8 samples, 128 new tokens
    python -m bench engine --prompts 8 --samples 2 8 16 --max-new-tokens 64
    python -m bench engine --impls tidal vllm hf_generate --rounds 2   # vLLM: in .venv-vllm
    python -m bench engine --model moe --prompts 8 --samples 4 --max-new-tokens 64 --rounds 2

Each measurement runs in its own subprocess (so peak memory is that run's alone), alternating
the engines, after one warm-up batch in the same process. Workload: `env:arithmetic` prompts
through SmolLM2-135M-Instruct's chat template, temperature 1, both engines in `--dtype` (auto:
bf16 where the CPU computes it natively, else fp32). The engines:

- `hf_generate`: one `model.generate(do_sample=True, num_return_sequences=n)` over the
  left-padded prompts; the batch runs until its longest sample ends (EOS-padded rows keep going).
- `tidal`: `LLMEngine.generate`: continuous batching, paged KV cache shared within each group.
- `tidal_int8`: the same with `engine.quantization: int8` (weight-only int8 linear layers: another
  policy, whose log-probs the engine returns; `tidal.engine.quant`).
- `tidal_invariant`: the same with `engine.batch_invariant: true` (`tidal.invariant`: each sequence
  computed as it would be alone, so a trainer under the same numerics scores its tokens with its
  log-probs bit for bit): the price of that guarantee.
- `vllm`: `VLLMCore` (vLLM's in-process engine, eager, `processed_logprobs`) stepped until the
  batch is done; the same requests and seeds. Its process runs in a Python with vLLM installed:
  this one, else `.venv-vllm` (scripts/setup_vllm.sh), else `--vllm-python`.

`--model hybrid` runs it on a Qwen3-Next of random weights (`HYBRID_CONFIG`): MOE_CONFIG's model
with three of every four layers Gated DeltaNet (3 key / 6 value heads of 64, conv kernel 4)
instead of attention, and a shared expert beside the routed ones; tidal keeps the GDN layers'
states in its state pool (`tidal.engine.states`), transformers in its cache.

`--model vision` runs it on the llava of examples/vision_shapes (SmolLM2-135M-Instruct with a
small random CLIP tower, built here once): the example's colour questions, one 32 x 32 picture
each (16 image tokens), `generate` with the processor's pixel batch, tidal with each prompt's
`vision.Image` (a group's samples share one prefill of the image).

`--model qwen-vision` runs it on a Qwen2.5-VL of random weights built here once (`QWEN_VISION_TEXT`:
MOE_CONFIG's width, heads and vocabulary with a dense MLP; a 2-layer vision tower): the arithmetic
prompts, each with a random 112 x 112 picture (16 image tokens) after its first three tokens.
Qwen's 3-D rotary positions: tidal's decode steps take the decode path at index + offset.

`--model moe` runs the same workload on a Qwen3-MoE of random weights built here once (no
checkpoint to download): SmolLM2's tokenizer and vocabulary, hidden 576, 16 layers, 9 query / 3
KV heads, 8 experts of width 768, top-2, renormalised (`MOE_CONFIG`), in the model cache beside
SmolLM2. Its samples rarely meet EOS, so both engines decode every sample to `--max-new-tokens`.
Both engines run transformers' own expert modules (`Qwen3MoeExperts`, whose default experts
implementation is `grouped_mm`).

Both paged engines get the same KV budget (`--kv-cache-tokens`, tidal's default 32768).

Useful tokens are the sampled tokens up to and including each sample's EOS. The table reports
them per second, the time to finish the batch, the process's peak RSS and, for tidal, the KV
memory actually referenced at the peak (blocks x bytes per block).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from bench.common import machine, peak_rss_mb, run_measurement, write_result

IMPLS = ("hf_generate", "tidal", "tidal_int8", "tidal_invariant", "vllm")
# the engine options of each tidal run
TIDAL_OPTIONS = {"tidal": {}, "tidal_int8": {"quantization": "int8"}, "tidal_invariant": {"batch_invariant": True}}
MODELS = ("smollm2", "moe", "hybrid", "vision", "qwen-vision")

# a small Qwen3-MoE shaped like SmolLM2 where the two can agree (width, heads, vocabulary, rotary)
MOE_CONFIG = {
    "vocab_size": 49152,
    "hidden_size": 576,
    "num_hidden_layers": 16,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 768,
    "intermediate_size": 1536,  # dense MLP width: unused (every layer is sparse)
    "norm_topk_prob": True,
    "max_position_embeddings": 8192,
    "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0},
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
    "initializer_range": 0.02,
}
# a small Qwen3-Next (hybrid: three Gated DeltaNet layers to one gated attention layer, as in
# Qwen3-Next-80B) with MOE_CONFIG's width, heads, vocabulary and experts, plus a shared expert
HYBRID_CONFIG = {
    **{k: v for k, v in MOE_CONFIG.items() if k != "rope_parameters"},
    "model_type": "qwen3_next",
    "full_attention_interval": 4,
    "linear_num_key_heads": 3,
    "linear_num_value_heads": 6,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "linear_conv_kernel_dim": 4,
    "shared_expert_intermediate_size": 768,
    "decoder_sparse_step": 1,
    "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0, "partial_rotary_factor": 0.25},
}
MOE_SEED = 0
# `--model qwen-vision`: a Qwen2.5-VL of random weights, its language model MOE_CONFIG's width,
# heads and vocabulary with a dense MLP (3-D rotary: 8 + 12 + 12 of the 32 frequencies), a
# 2-layer vision tower; the last four ids of the vocabulary are its image and video tokens
QWEN_VISION_IDS = {"video_token_id": 49148, "image_token_id": 49149, "vision_start_token_id": 49150}
QWEN_VISION_IDS["vision_end_token_id"] = 49151
QWEN_VISION_TEXT = {
    **{k: v for k, v in MOE_CONFIG.items() if "expert" not in k and k not in ("norm_topk_prob", "rope_parameters")},
    "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0, "mrope_section": [8, 12, 12]},
}
QWEN_VISION_TOWER = {
    "depth": 2,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_heads": 2,
    "out_hidden_size": 576,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "fullatt_block_indexes": [1],
    "window_size": 112,
}
QWEN_VISION_PIXELS = 112  # a square picture: 8 x 8 patches, 16 image tokens after the 2 x 2 merge


def random_model(name: str) -> Path:
    """The bench's random model folder (`--model moe`: `MOE_CONFIG`; `hybrid`: `HYBRID_CONFIG`;
    weights drawn from `MOE_SEED` by transformers' own init, SmolLM2's tokenizer), built on first
    use beside the converted SmolLM2."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from tidal.convert import default_cache_dir, ensure_model

    values = dict(HYBRID_CONFIG if name == "hybrid" else {"model_type": "qwen3_moe", **MOE_CONFIG})
    kind = values.pop("model_type")
    out = default_cache_dir() / f"bench-{kind.replace('_', '-')}-random-seed{MOE_SEED}"
    if (out / "config.json").exists():
        return out
    tok = AutoTokenizer.from_pretrained(str(ensure_model("smollm2")))
    ids = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    return _save_random(out, AutoModelForCausalLM, AutoConfig.for_model(kind, **values, **ids), tok)


def _save_random(out: Path, auto, config, tokenizer) -> Path:
    """`auto`'s model of `config` with weights drawn from `MOE_SEED` by transformers' own init,
    saved with `tokenizer` as the folder `out` (written whole or not at all)."""
    from tidal.utils import atomic_directory

    torch.manual_seed(MOE_SEED)
    model = auto.from_config(config).float()
    with atomic_directory(out) as tmp:
        model.save_pretrained(str(tmp), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
    return out


def vision_example():
    """examples/vision_shapes/build.py as a module (its model and picture builders)."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "examples" / "vision_shapes" / "build.py"
    spec = importlib.util.spec_from_file_location("vision_shapes_build", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def vision_model() -> Path:
    """`--model vision`: the llava of examples/vision_shapes (SmolLM2-135M-Instruct with a small
    random CLIP tower, seed 0), built on first use beside the converted SmolLM2."""
    from tidal.convert import default_cache_dir
    from tidal.utils import atomic_directory

    out = default_cache_dir() / "bench-llava-smollm2-seed0"
    if not (out / "model" / "config.json").exists():
        with atomic_directory(out) as tmp:
            vision_example().build_model(tmp)
    return out / "model"


def qwen_vision_model() -> Path:
    """`--model qwen-vision`: the random Qwen2.5-VL (`QWEN_VISION_TEXT`, `QWEN_VISION_TOWER`),
    weights from `MOE_SEED`, SmolLM2's tokenizer; built on first use beside the converted SmolLM2."""
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoTokenizer

    from tidal.convert import default_cache_dir, ensure_model

    out = default_cache_dir() / f"bench-qwen2-5-vl-random-seed{MOE_SEED}"
    if (out / "config.json").exists():
        return out
    tok = AutoTokenizer.from_pretrained(str(ensure_model("smollm2")))
    ids = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    text = {**QWEN_VISION_TEXT, **ids}
    config = AutoConfig.for_model("qwen2_5_vl", text_config=text, vision_config=QWEN_VISION_TOWER, **QWEN_VISION_IDS)
    return _save_random(out, AutoModelForImageTextToText, config, tok)


def _qwen_vision_prompts(tokenizer, n_prompts: int, level: int) -> tuple[list[list[int]], list]:
    """`--model qwen-vision`: the arithmetic prompts, each with a random picture's tokens after
    its first three (vision start, 16 image tokens, vision end), and that picture as its
    `vision.Image` (Qwen2-VL's image processor)."""
    import numpy as np
    from PIL import Image as PILImage
    from transformers import Qwen2VLImageProcessorPil

    from tidal import vision

    size = QWEN_VISION_PIXELS
    processor = Qwen2VLImageProcessorPil(min_pixels=size * size, max_pixels=size * size, patch_size=14, merge_size=2)
    rng = np.random.default_rng(7)
    run = [QWEN_VISION_IDS["vision_start_token_id"], *[QWEN_VISION_IDS["image_token_id"]] * 16]
    run.append(QWEN_VISION_IDS["vision_end_token_id"])
    prompts, images = [], []
    for p in _prompts(tokenizer, n_prompts, level):
        picture = PILImage.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))
        out = processor(images=[picture], return_tensors="pt")
        images.append([vision.Image.of({k: out[k] for k in vision.FAMILIES["qwen2_5_vl"].inputs})])
        prompts.append(p[:3] + run + p[3:])
    return prompts, images


def bench_model(name: str) -> Path:
    """The local folder of `--model`."""
    from tidal.convert import ensure_model

    if name == "vision":
        return vision_model()
    if name == "qwen-vision":
        return qwen_vision_model()
    return ensure_model("smollm2") if name == "smollm2" else random_model(name)


def _prompts(tokenizer, n_prompts: int, level: int) -> list[list[int]]:
    from tidal.data.dataset import build_prompts
    from tidal.data.envs import make_env_rows

    rows = make_env_rows("arithmetic", level=level, n=n_prompts, seed=7)
    records, _ = build_prompts(rows, tokenizer, source="bench")
    return [r.input_ids for r in records]


def _vision_prompts(tokenizer, n_prompts: int, model_dir: Path) -> tuple[list[list[int]], list]:
    """`--model vision`: the example's colour questions, one 32 x 32 picture each (drawn in a
    temporary folder): (prompt ids, each prompt's images)."""
    import tempfile

    from tidal.data.dataset import load_prompts
    from tidal.data.images import ImageReader

    with tempfile.TemporaryDirectory() as tmp:
        data = vision_example().write_data(Path(tmp), n_prompts, seed=7)
        records, _ = load_prompts(data, tokenizer, images=ImageReader.for_model(model_dir, Path(tmp)))
    return [r.input_ids for r in records], [r.images for r in records]


def _run_hf(model_dir, tokenizer, prompts, n, max_new, seed, dtype, images=None) -> dict:
    from tidal import vision
    from tidal.hardware import TORCH_DTYPES

    model = vision.load_pretrained(model_dir, TORCH_DTYPES[dtype]).eval()
    pixels = {}
    if images:  # one image per prompt: the processor's batch of them
        family = vision.family(model.config)
        pixels = vision.batch([im for ims in images for im in ims], family.inputs)
        token = vision.image_token(model.config)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    if images and family.mrope:  # which tokens are the images' (Qwen's 3-D positions)
        pixels["mm_token_type_ids"] = (ids == token).int()
    eos = tokenizer.eos_token_id

    def once():
        torch.manual_seed(seed)
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                **pixels,
                do_sample=True,
                temperature=1.0,
                top_p=1.0,
                top_k=0,
                max_new_tokens=max_new,
                num_return_sequences=n,
                pad_token_id=pad,
                eos_token_id=eos,
            )
        gen = out[:, width:].tolist()
        useful = 0
        for row in gen:
            useful += row.index(eos) + 1 if eos in row else len(row)
        return useful, len(gen[0])

    with torch.inference_mode():  # warm-up: allocator, kernels
        # the first prompt's images alone (Qwen's pixel rows are patches, not one per image)
        first = vision.batch(images[0], family.inputs) if images else {}
        if "mm_token_type_ids" in pixels:
            first["mm_token_type_ids"] = pixels["mm_token_type_ids"][:1]
        model.generate(
            input_ids=ids[:1], attention_mask=mask[:1], max_new_tokens=4, do_sample=False, pad_token_id=pad, **first
        )
    t0 = time.perf_counter()
    useful, steps = once()
    return {"useful_tokens": useful, "seconds": time.perf_counter() - t0, "decode_steps": steps}


def _requests(prompts, n, max_new, seed) -> tuple[list[list[int]], list]:
    """Each prompt n times, each sample with the seed the rollout would give it."""
    from tidal.contracts import SamplingParams
    from tidal.rollout.manager import sample_seed

    batch, params = [], []
    for g, p in enumerate(prompts):
        for j in range(n):
            batch.append(p)
            params.append(SamplingParams(temperature=1.0, max_new_tokens=max_new, seed=sample_seed(seed, 0, g * n + j)))
    return batch, params


def _run_tidal(
    model_dir, tokenizer, prompts, n, max_new, seed, dtype, kv_cache_tokens, options=None, images=None
) -> dict:
    from tidal.engine.llm_engine import LLMEngine

    t0 = time.perf_counter()
    engine = LLMEngine(model_dir, tokenizer, dtype=dtype, kv_cache_tokens=kv_cache_tokens, **(options or {}))
    startup = time.perf_counter() - t0
    batch, params = _requests(prompts, n, max_new, seed)
    pictures = [ims for ims in (images or [[] for _ in prompts]) for _ in range(n)]  # a group shares its list
    engine.generate_batch(batch[:2], params[:2], pictures[:2])  # warm-up
    engine.flush_cache()  # the warm-up's prompt blocks and image features are not the batch's to reuse
    before = engine.stats()
    t0 = time.perf_counter()
    outs = engine.generate_batch(batch, params, pictures)
    seconds = time.perf_counter() - t0
    st = engine.stats()
    return {
        "useful_tokens": sum(len(o.token_ids) for o in outs),
        "seconds": seconds,
        "kv_peak_mb": st["kv_blocks_peak"] * st["kv_bytes_per_block"] / 2**20,
        "prefix_hit_blocks": st["prefix_hit_blocks"],
        # prompt tokens computed, and those a group's twins copied instead (`tidal.engine.scheduler`)
        "prefill_tokens": st["prefill_tokens"] - before["prefill_tokens"],
        "prefill_tokens_copied": st["prefill_tokens_copied"] - before["prefill_tokens_copied"],
        "steps": st["steps"],
        "startup_s": startup,
    }


def _run_vllm(model_dir, tokenizer, prompts, n, max_new, seed, dtype, kv_cache_tokens) -> dict:
    from tidal.adapters.vllm_core import VLLMCore

    t0 = time.perf_counter()
    core = VLLMCore(model_dir, tokenizer, dtype=dtype, kv_cache_tokens=kv_cache_tokens)
    startup = time.perf_counter() - t0
    batch, params = _requests(prompts, n, max_new, seed)

    def generate(batch, params, tag):
        for i, (p, sp) in enumerate(zip(batch, params, strict=True)):
            core.add_request(f"{tag}{i}", p, sp)
        outs = []
        while core.has_unfinished():
            outs += core.step()
        return outs

    generate(batch[:2], params[:2], "w")  # warm-up
    steps0 = core.stats()["steps"]
    t0 = time.perf_counter()
    outs = generate(batch, params, "r")
    seconds = time.perf_counter() - t0
    st = core.stats()
    core.close()
    return {
        "useful_tokens": sum(len(o.token_ids) for o in outs),
        "seconds": seconds,
        "cached_prompt_tokens": st["cached_prompt_tokens"],
        "steps": st["steps"] - steps0,
        "startup_s": startup,
    }


def _vllm_python(given: str | None) -> str:
    """A Python that can import vLLM: `given`, this one, or the repository's .venv-vllm."""
    import importlib.util
    from pathlib import Path

    if given:
        return given
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    venv = Path(__file__).resolve().parent.parent / ".venv-vllm" / "bin" / "python"
    if venv.exists():
        return str(venv)
    sys.exit("bench engine --impls vllm: no Python with vLLM here; run scripts/setup_vllm.sh or pass --vllm-python")


def child(args) -> None:
    """One measurement in this process; prints a JSON line."""
    from transformers import AutoTokenizer

    torch.set_num_threads(args.threads)
    model_dir = bench_model(args.model)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    if args.model == "vision":
        prompts, images = _vision_prompts(tok, args.prompts, model_dir)
    elif args.model == "qwen-vision":
        prompts, images = _qwen_vision_prompts(tok, args.prompts, args.level)
    else:
        prompts, images = _prompts(tok, args.prompts, args.level), None
    if args.impl == "hf_generate":
        res = _run_hf(model_dir, tok, prompts, args.child_samples, args.max_new_tokens, args.seed, args.dtype, images)
    elif args.impl in TIDAL_OPTIONS:
        res = _run_tidal(
            model_dir,
            tok,
            prompts,
            args.child_samples,
            args.max_new_tokens,
            args.seed,
            args.dtype,
            args.kv_cache_tokens,
            TIDAL_OPTIONS[args.impl],
            images,
        )
    else:
        if images:
            raise SystemExit("bench engine --model vision: the vLLM run takes no images here")
        n, kv = args.child_samples, args.kv_cache_tokens
        res = _run_vllm(model_dir, tok, prompts, n, args.max_new_tokens, args.seed, args.dtype, kv)
    import transformers

    res.update(impl=args.impl, samples=args.child_samples, dtype=args.dtype, peak_rss_mb=peak_rss_mb())
    # the vLLM runs may come from another environment (vLLM pins its own transformers)
    res.update(torch=torch.__version__, transformers=transformers.__version__)
    if args.impl == "vllm":
        import vllm

        res["vllm"] = vllm.__version__
    print("RESULT " + json.dumps(res), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description="tidal engine vs vLLM vs transformers generate on a GRPO rollout")
    p.add_argument(
        "--model",
        default="smollm2",
        choices=MODELS,
        help="SmolLM2-135M, the random Qwen3-MoE or Qwen3-Next, the llava example, the random Qwen2.5-VL",
    )
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--samples", type=int, nargs="+", default=[8], help="samples per prompt (several: a sweep)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--level", type=int, default=3, help="env:arithmetic level of the prompts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--seeds", type=int, nargs="+", help="sampling seeds, each run by every engine in every round (default: --seed)"
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"), help="both engines' weights")
    p.add_argument("--impls", nargs="+", default=["hf_generate", "tidal"], choices=IMPLS)
    p.add_argument("--rounds", type=int, default=1, help="alternate the engines this many times")
    p.add_argument("--kv-cache-tokens", type=int, default=32768, help="the paged engines' KV budget")
    p.add_argument("--vllm-python", help="a Python with vLLM for the vllm runs (default: this, else .venv-vllm)")
    p.add_argument("--tag", help="a word for the result file name (a workload other than the reference one)")
    p.add_argument("--impl", help=argparse.SUPPRESS)
    p.add_argument("--child-samples", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.impl:
        return child(args)
    from tidal.hardware import resolve_dtype

    args.dtype = resolve_dtype(args.dtype, "bench engine --dtype").dtype  # the children run exactly this
    model_dir = bench_model(args.model)  # built here once, not by two children at a time
    print(f"model: {model_dir}", flush=True)

    python = {impl: _vllm_python(args.vllm_python) if impl == "vllm" else sys.executable for impl in args.impls}
    # The engines draw different tokens from one seed (their own random streams), so one seed's
    # samples may be longer for one engine by luck (14% more tokens at 32 samples); several seeds,
    # each run by every engine, even that out.
    seeds = args.seeds or [args.seed]
    rows = []
    for n in args.samples:
        for rnd in range(args.rounds):
            for seed in seeds:
                for impl in args.impls:  # alternating, each in a fresh process
                    cmd = [python[impl], "-m", "bench", "engine", "--impl", impl, "--child-samples", str(n)]
                    for k in ("model", "prompts", "max_new_tokens", "level", "threads", "dtype", "kv_cache_tokens"):
                        cmd += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
                    r = run_measurement([*cmd, "--seed", str(seed)], f"{impl} (samples {n})")
                    r["tokens_per_s"] = r["useful_tokens"] / r["seconds"]
                    r["round"], r["seed"] = rnd, seed
                    rows.append(r)
                    print(
                        f"  {impl:<12} n={n:<3} seed {seed:<3} {r['useful_tokens']:>6} tokens  {r['seconds']:7.1f} s",
                        flush=True,
                    )

    print(
        f"\n{'engine':<12}{'samples':>8}{'round':>6}{'seed':>6}{'tokens':>8}{'tok/s':>8}{'batch s':>9}"
        f"{'start s':>9}{'peak RSS MB':>13}{'KV MB':>8}"
    )
    for r in rows:
        kv = f"{r['kv_peak_mb']:.0f}" if "kv_peak_mb" in r else "-"
        start = f"{r['startup_s']:.1f}" if "startup_s" in r else "-"
        print(
            f"{r['impl']:<12}{r['samples']:>8}{r['round']:>6}{r['seed']:>6}{r['useful_tokens']:>8}"
            f"{r['tokens_per_s']:>8.0f}{r['seconds']:>9.1f}{start:>9}{r['peak_rss_mb']:>13.0f}{kv:>8}"
        )
    # each engine's mean over the rounds, relative to transformers and to tidal
    ratios = {}
    for n in args.samples:
        mean = {}
        for impl in args.impls:
            runs = [r for r in rows if r["samples"] == n and r["impl"] == impl]
            mean[impl] = sum(r["tokens_per_s"] for r in runs) / len(runs)
        ratios[n] = {f"{a}/{b}": mean[a] / mean[b] for a in mean for b in mean if a != b and b != "vllm"}
        print(f"samples {n}: mean tokens/s " + ", ".join(f"{k} {v:.0f}" for k, v in mean.items()))
        print(f"samples {n}: " + ", ".join(f"{k} x{v:.2f}" for k, v in ratios[n].items()))
    settings = {k: v for k, v in vars(args).items() if k not in ("impl", "child_samples")}
    payload = {"machine": machine(), "settings": settings, "rows": rows, "ratios": ratios}
    # a run with vLLM, of another model or tagged keeps its own file: the SmolLM2 tidal/transformers
    # result stays the reference one
    parts = [
        "engine",
        args.model if args.model != "smollm2" else "",
        "vllm" if "vllm" in args.impls else "",
        args.tag or "",
        args.dtype,
    ]
    path = write_result("-".join(x for x in parts if x), payload)
    print(f"wrote {path}")
