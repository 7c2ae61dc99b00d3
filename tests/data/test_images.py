"""Prompt rows whose messages hold images (`tidal.data.images`): a path, a data: URI and Parquet
bytes become the model's processor's token ids and one `vision.Image` per image, which the engine
runs to transformers' own tokens for the processor's batch; bad images stop with the file, line,
field, message and part named."""

from __future__ import annotations

import base64
import io
import json

import pytest
import torch
from vision_models import IMAGE_TOKEN, picture, processor, tiny_vlm

from tidal import vision
from tidal.contracts import SamplingParams
from tidal.data.dataset import DataError, load_prompts
from tidal.data.images import ImageReader
from tidal.engine.llm_engine import LLMEngine

pytestmark = pytest.mark.usefixtures("one_thread")


def png(seed: int) -> bytes:
    buf = io.BytesIO()
    picture(seed).save(buf, format="PNG")
    return buf.getvalue()


def reader(family: str, folder, **kw) -> ImageReader:
    return ImageReader(processor(family), vision.FAMILIES[family], folder, **kw)


def user(*parts) -> list[dict]:
    return [{"role": "user", "content": list(parts)}]


def write_jsonl(path, prompts: list) -> None:
    path.write_text("".join(json.dumps({"prompt": p, "label": "x"}) + "\n" for p in prompts))


@pytest.mark.parametrize("family", ["llava", "idefics3", "gemma3"])
def test_images_from_a_path_and_a_data_uri_run_as_transformers_runs_the_processor_batch(family, tmp_path):
    (tmp_path / "pics").mkdir()
    (tmp_path / "pics" / "a.png").write_bytes(png(0))
    uri = "data:image/png;base64," + base64.b64encode(png(1)).decode()
    text = {"type": "text", "text": "how many?"}
    rows = [
        user({"type": "image", "image": "pics/a.png"}, text),
        user(text, {"type": "image_url", "image_url": {"url": uri}}, {"type": "image", "path": "pics/a.png"}),
    ]
    write_jsonl(tmp_path / "d.jsonl", rows)
    records, dropped = load_prompts(tmp_path / "d.jsonl", None, images=reader(family, tmp_path))
    assert dropped == 0 and [len(r.images) for r in records] == [1, 2]
    assert records[1].images[1].digest == records[0].images[0].digest  # the same file, the same key
    assert records[1].messages[0]["content"][1] == {"type": "image"}  # the pixels are kept once
    proc, model = processor(family), tiny_vlm(family)
    engine = LLMEngine(tiny_vlm(family), None, dtype="float32", block_size=4, kv_cache_tokens=1024)
    for r, pics in zip(records, [[picture(0)], [picture(1), picture(0)]], strict=True):
        batch = proc(text=[r.text], images=[pics], return_tensors="pt")
        assert r.input_ids == batch["input_ids"][0].tolist() and IMAGE_TOKEN in r.input_ids
        # Gemma 3's token types: which tokens attend within their image both ways
        kw = {k: v for k, v in batch.items() if k in (*vision.FAMILIES[family].inputs, "token_type_ids")}
        with torch.no_grad():
            want = model.generate(batch["input_ids"], **kw, max_new_tokens=6, min_new_tokens=6, do_sample=False)
        greedy = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
        (out,) = engine.generate_batch([r.input_ids], [greedy], images=[r.images])
        assert out.token_ids == want[0, len(r.input_ids) :].tolist()


def test_parquet_image_bytes_are_read(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    row = user({"type": "image", "image": {"bytes": png(2), "path": None}}, {"type": "text", "text": "q"})
    pq.write_table(pa.Table.from_pylist([{"prompt": row}]), tmp_path / "d.parquet")
    (record,), _ = load_prompts(tmp_path / "d.parquet", None, images=reader("llava", tmp_path))
    direct = reader("llava", tmp_path).one(picture(2))
    assert record.images[0].digest == direct.digest


@pytest.mark.parametrize(
    ("part", "expected"),
    [
        (
            {"type": "image", "image": "nope.png"},
            r"d.jsonl:2: 'prompt': message 0 part 1: image file .*nope.png not found",
        ),
        ({"type": "image", "image": "bad.png"}, r"d.jsonl:2: 'prompt': message 0 part 1: .*bad.png is not an image"),
        ({"type": "image", "image": "big.png"}, r"big.png is 50x60 pixels, more than data.max_image_pixels \(2000\)"),
        ({"type": "image_url", "image_url": "https://x/y.png"}, r"https://x/y.png is a URL; nothing is downloaded"),
        ({"type": "image", "image": "data:image/png,xyz"}, r"a data: URI must be base64"),
        ({"type": "image", "image": 7}, r"an image part needs a path, a data: URI or bytes, got int"),
    ],
)
def test_bad_images_are_named(tmp_path, part, expected):
    (tmp_path / "bad.png").write_text("not a picture")
    (tmp_path / "big.png").write_bytes(png(0))
    ok = user({"type": "text", "text": "fine"})
    write_jsonl(tmp_path / "d.jsonl", [ok, user({"type": "text", "text": "q"}, part)])
    with pytest.raises(DataError, match=expected):
        load_prompts(tmp_path / "d.jsonl", None, images=reader("llava", tmp_path, max_pixels=2000))


def test_images_for_a_text_model_are_refused(tmp_path, tokenizer):
    write_jsonl(tmp_path / "d.jsonl", [user({"type": "image", "image": "a.png"})])
    with pytest.raises(DataError, match=r"d.jsonl:1: 'prompt' holds images; the model takes none"):
        load_prompts(tmp_path / "d.jsonl", tokenizer)
