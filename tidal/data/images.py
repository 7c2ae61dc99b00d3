"""Images in prompt rows, read with the model's own processor.

A row's messages may hold image parts beside text parts, written as chat templates or OpenAI's
API write them:

    {"type": "image", "image": VALUE}            {"type": "image", "path": VALUE}
    {"type": "image_url", "image_url": {"url": VALUE}}      {"type": "image_url", "image_url": VALUE}

VALUE is a file path (relative to the data file's folder), a `data:image/...;base64,...` URI, or
the image's bytes (a Parquet binary column, or the `{"bytes": ..., "path": ...}` struct Hugging Face
datasets write). Nothing is downloaded: an http(s) URL is an error.

The model's processor renders the conversation with its chat template and expands each image's
marker into its placeholder tokens; each image's own tensors come from the processor's image
processor, one image at a time, as a `tidal.vision.Image` (its content digest keys the prefix
cache). The record keeps the images once, and the messages with each image part reduced to
`{"type": "image"}`: the pixels are not kept twice.

A missing file, bytes that are not an image, or an image of more than `max_pixels` pixels stop
the run with an error naming the file and line, the field and the message and part.
"""

from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tidal import vision
from tidal.data.dataset import IMAGE_TYPES, DataError


def _value(part: dict) -> Any:
    """What an image part points at (see the module docstring)."""
    if part["type"] == "image_url":
        url = part.get("image_url")
        return url.get("url") if isinstance(url, dict) else url
    for key in ("image", "path", "url", "bytes"):
        if part.get(key) is not None:
            return part[key]
    return None


@dataclass
class ImageReader:
    """Turns a row's messages with image parts into the prompt's text, token ids and images.

    `processor`: the model's (`transformers.AutoProcessor`); `family`: its `tidal.vision.Family`;
    `base_dir`: where relative image paths start; `max_pixels`: the largest image accepted."""

    processor: Any
    family: vision.Family
    base_dir: Path
    max_pixels: int = 4096 * 4096

    @classmethod
    def for_model(cls, model_dir: str | Path, base_dir: Path, max_pixels: int = 4096 * 4096) -> ImageReader | None:
        """The reader of a vision-language model folder (`tidal.vision.FAMILIES`): its processor
        (transformers' `AutoProcessor`); None for a text-only model."""
        family = vision.folder_family(model_dir)
        if family is None:
            return None
        from transformers import AutoProcessor

        try:
            processor = AutoProcessor.from_pretrained(str(model_dir))
        except (ImportError, OSError, ValueError, AttributeError) as e:
            raise DataError(
                f"model {model_dir}: its processor (images into tokens) does not load: {e} "
                "(the Qwen-VL processors need torchvision, SmolVLM's num2words)"
            ) from None
        return cls(processor, family, base_dir, max_pixels)

    def open(self, value: Any, where: str) -> tuple[Any, bytes]:
        """A part's value as (a PIL image, fully decoded; the bytes of its file), errors naming
        `where`."""
        from PIL import Image as PILImage
        from PIL import UnidentifiedImageError

        if isinstance(value, dict):  # Hugging Face datasets' image struct
            value = value.get("bytes") or value.get("path")
        if isinstance(value, str) and value.startswith("data:"):
            head, _, payload = value.partition(",")
            if not head.endswith(";base64"):
                raise DataError(f"{where}: a data: URI must be base64 (data:image/png;base64,...)")
            try:
                value = base64.b64decode(payload, validate=True)
            except (binascii.Error, ValueError) as e:
                raise DataError(f"{where}: the data: URI is not valid base64 ({e})") from None
        if isinstance(value, str):
            if value.startswith(("http://", "https://")):
                raise DataError(f"{where}: {value} is a URL; nothing is downloaded: give a path, a data: URI or bytes")
            path = Path(value) if Path(value).is_absolute() else self.base_dir / value
            if not path.is_file():
                raise DataError(f"{where}: image file {path} not found")
            raw, name = path.read_bytes(), str(path)
        elif isinstance(value, (bytes, bytearray, memoryview)):
            raw, name = bytes(value), "the image bytes"
        else:
            kind = "null" if value is None else type(value).__name__
            raise DataError(f"{where}: an image part needs a path, a data: URI or bytes, got {kind}")
        try:
            image = PILImage.open(io.BytesIO(raw))
            w, h = image.size
            if w * h > self.max_pixels:
                raise DataError(
                    f"{where}: {name} is {w}x{h} pixels, more than data.max_image_pixels ({self.max_pixels})"
                )
            return image.convert("RGB"), raw
        except (UnidentifiedImageError, OSError, PILImage.DecompressionBombError) as e:
            raise DataError(f"{where}: {name} is not an image ({e})") from None

    def prompt(self, messages: list[dict], where: str) -> tuple[list[dict], str, list[int], list[vision.Image]]:
        """(the messages with image parts as `{"type": "image"}`, the rendered text, its token ids
        with the images' placeholders expanded, the images in order)."""
        plain, pictures, files = [], [], []
        for i, m in enumerate(messages):
            content = m.get("content")
            if not isinstance(content, list):
                plain.append(m)
                continue
            parts = []
            for j, part in enumerate(content):
                if isinstance(part, dict) and part.get("type") in IMAGE_TYPES:
                    picture, raw = self.open(_value(part), f"{where}: message {i} part {j}")
                    pictures.append(picture)
                    files.append(raw)
                    parts.append({"type": "image"})
                else:
                    parts.append(part)
            plain.append({**m, "content": parts})
        text = self.processor.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)
        images = [self.one(picture, raw) for picture, raw in zip(pictures, files, strict=True)]
        return plain, text, self.ids(text, pictures), images

    def ids(self, text: str, pictures: list) -> list[int]:
        """The token ids of a rendered prompt `text` with each image marker expanded by the
        processor into the placeholders of its picture (PIL images, in order)."""
        given = {"images": [pictures]} if pictures else {}
        return self.processor(text=[text], return_tensors="pt", **given)["input_ids"][0].tolist()

    def one(self, picture, source: bytes = b"") -> vision.Image:
        """One PIL image as the model's image processor makes it, alone (`source`: the file it
        was read from, kept for a served engine)."""
        out = self.processor.image_processor(images=[picture], return_tensors="pt")
        return vision.Image.of({k: v for k, v in out.items() if k in self.family.inputs}, source)
