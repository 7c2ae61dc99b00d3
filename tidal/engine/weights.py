"""Loading new weights into an engine's model: by name from tensors, or from a safetensors folder.

A load is all or nothing: every tensor is checked against the model (name, shape, a floating
dtype) and for NaN or infinite values before any live weight changes, so a bad update leaves the
engine on its old weights.
`weights_checksum` fingerprints what a model holds, so a trainer can check that an engine loaded
exactly what it sent.

A tensor too large for one request of a chunked update travels in pieces (`piece_name`): each a
run of the tensor's flattened (row-major) elements, named `NAME@OFFSET/SHAPE`, e.g.
`model.embed_tokens.weight@7077888/49152x576` (elements 7077888 on of that 49152 x 576 tensor;
the piece's dtype is the tensor's). `WeightStage` puts the pieces together as they arrive and
loads the tensor only when every element arrived exactly once.
"""

from __future__ import annotations

import math
import re
import zlib
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch


class WeightsError(ValueError):
    """An update names a parameter the model lacks, leaves one out, has a wrong shape or dtype,
    or holds NaN or infinite values."""


def _targets(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    params = dict(model.named_parameters())
    params.update(dict(model.named_buffers()))
    return params


def _check_target(targets: dict[str, torch.Tensor], name: str, shape: tuple, dtype: torch.dtype, where: str) -> None:
    """Raise `WeightsError` unless the model has a parameter or buffer `name` of this shape, floating
    point where `dtype` is."""
    if name not in targets:
        raise WeightsError(f"{where}: the engine's model has no parameter {name!r}")
    target = targets[name]
    if tuple(shape) != tuple(target.shape):
        raise WeightsError(f"{where}: {name} has shape {tuple(shape)}, the engine's is {tuple(target.shape)}")
    if target.is_floating_point() != dtype.is_floating_point:
        raise WeightsError(f"{where}: {name} has dtype {dtype}, the engine's is {target.dtype}")


def check_named_tensors(
    model: torch.nn.Module, named: dict[str, torch.Tensor], complete: bool = True, where: str = "update_weights"
) -> None:
    """Raise `WeightsError` (naming the tensor) unless every tensor matches a parameter or buffer of
    `model` in shape, is floating point where the target is and holds only finite values (an
    engine fed NaN answers garbage); with `complete`, every parameter must be given, except an
    output projection tied to the input embedding (one name only)."""
    targets = _targets(model)
    for name, tensor in named.items():
        _check_target(targets, name, tuple(tensor.shape), tensor.dtype, where)
    for name, tensor in named.items():
        bad = non_finite(tensor)
        if bad:
            raise WeightsError(
                f"{where}: {name} holds {bad} NaN or infinite value(s) of {tensor.numel()}; weights must be finite"
            )
    if complete:
        tied = getattr(model.config, "tie_word_embeddings", False)
        missing = {n for n, _ in model.named_parameters()} - set(named)
        missing = {n for n in missing if not (tied and n == "lm_head.weight")}
        if missing:
            raise WeightsError(f"{where}: no tensor given for {sorted(missing)[:5]}")


# a piece's wire name, NAME@OFFSET/SHAPE (see the module docstring)
_PIECE = re.compile(r"(?P<name>.+)@(?P<offset>\d+)/(?P<shape>\d+(?:x\d+)*)")
_WHERE = "update_weights"


def piece_name(name: str, offset: int, shape: Sequence[int]) -> str:
    """The name a piece of tensor `name` (of `shape`) travels under: its elements from flat (row-
    major) element `offset` on, e.g. `model.embed_tokens.weight@7077888/49152x576`."""
    return f"{name}@{offset}/{'x'.join(map(str, shape))}"


def parse_piece(key: str) -> tuple[str, int, tuple[int, ...]] | None:
    """(tensor name, offset, the whole tensor's shape) of a piece's name; None for a whole tensor."""
    m = _PIECE.fullmatch(key)
    if m is None:
        return None
    return m["name"], int(m["offset"]), tuple(int(d) for d in m["shape"].split("x"))


def _span(offset: int, end: int) -> str:
    return f"elements [{offset}, {end})"


class _Assembly:
    """One tensor arriving in pieces: a flat buffer of its dtype, and the element spans received."""

    def __init__(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.name, self.shape, self.dtype = name, shape, dtype
        self.flat = torch.empty(math.prod(shape), dtype=dtype)
        self.spans: list[tuple[int, int]] = []  # [start, end) of each piece received

    def describe(self) -> str:
        return f"{self.name} ({'x'.join(map(str, self.shape))}, {self.dtype})"

    def put(self, offset: int, shape: tuple[int, ...], piece: torch.Tensor) -> None:
        """Copy a piece in; `WeightsError` naming the tensor when the piece disagrees with the
        earlier ones (shape, dtype), runs past the end or overlaps a piece received already."""
        end, total = offset + piece.numel(), self.flat.numel()
        if shape != self.shape or piece.dtype != self.dtype:
            raise WeightsError(
                f"{_WHERE}: a piece of {self.name} says {'x'.join(map(str, shape))}, {piece.dtype}; an earlier "
                f"one said {'x'.join(map(str, self.shape))}, {self.dtype}: the pieces are not of one tensor"
            )
        if end > total:
            raise WeightsError(
                f"{_WHERE}: a piece of {self.describe()} at {_span(offset, end)} runs past its {total} elements"
            )
        for a, b in self.spans:
            if offset < b and a < end:
                raise WeightsError(
                    f"{_WHERE}: a piece of {self.describe()} at {_span(offset, end)} overlaps {_span(a, b)}, "
                    "received already: every piece is sent once; send the whole update again"
                )
        self.flat[offset:end] = piece.reshape(-1)
        self.spans.append((offset, end))

    def whole(self) -> torch.Tensor:
        """The tensor, once every element has arrived; else `WeightsError` naming the first gap."""
        at, total = 0, self.flat.numel()
        for a, b in sorted(self.spans):
            if a > at:
                break
            at = b
        if at < total:
            later = [a for a, _ in self.spans if a > at]
            raise WeightsError(
                f"{_WHERE}: {self.describe()} is missing {_span(at, min(later, default=total))} of its {total} "
                f"({len(self.spans)} piece(s) arrived): a piece was not sent; send the whole update again"
            )
        return self.flat.view(self.shape)


def _split(named: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[tuple]]:
    """(the whole tensors, [(name, offset, shape, piece), ...]) of one call's tensors."""
    whole, pieces = {}, []
    for key, tensor in named.items():
        parsed = parse_piece(key)
        if parsed is None:
            whole[key] = tensor
        else:
            pieces.append((*parsed, tensor))
    return whole, pieces


def _check_pieces(model: torch.nn.Module, pieces: list[tuple]) -> None:
    """`WeightsError` unless each piece's tensor is the model's (name, shape, floating dtype), so
    no buffer is made for a shape the model lacks, and the piece holds only finite values."""
    targets = _targets(model)
    for name, offset, shape, piece in pieces:
        _check_target(targets, name, shape, piece.dtype, _WHERE)
        bad = non_finite(piece)
        if bad:
            span = _span(offset, offset + piece.numel())
            raise WeightsError(
                f"{_WHERE}: {name} holds {bad} NaN or infinite value(s) in its piece at {span}; weights must be finite"
            )


class WeightStage:
    """The chunks of one weight update sent in parts (calls with `stage=True`): each chunk is
    checked against the model as it arrives and kept, a tensor sent in pieces put together as they
    arrive (see the module docstring); the update's last call loads them all at once, so an update
    sent in chunks is all or nothing too. A bad chunk drops what was staged, and so does a last
    call that leaves a tensor sent in pieces incomplete."""

    def __init__(self) -> None:
        self._named: dict[str, torch.Tensor] = {}
        self._pieces: dict[str, _Assembly] = {}

    def add(self, model: torch.nn.Module, named: dict[str, torch.Tensor]) -> None:
        try:
            whole, pieces = _split(named)
            check_named_tensors(model, whole, complete=False)
            _check_pieces(model, pieces)
            self._gather(whole, pieces)
        except WeightsError:
            self.clear()
            raise
        self._named.update(whole)

    def _gather(self, whole: dict[str, torch.Tensor], pieces: list[tuple]) -> None:
        """Put pieces into their tensors; a tensor may come whole or in pieces, not both."""
        for name, offset, shape, piece in pieces:
            if name in self._named or name in whole:
                raise WeightsError(f"{_WHERE}: {name} came both whole and in pieces; send it one way")
            if name not in self._pieces:
                self._pieces[name] = _Assembly(name, shape, piece.dtype)
            self._pieces[name].put(offset, shape, piece)
        both = sorted(set(whole) & set(self._pieces))
        if both:
            raise WeightsError(f"{_WHERE}: {both[0]} came both whole and in pieces; send it one way")

    def take(self, model: torch.nn.Module, named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every staged tensor, with the last call's `named` over them (its pieces put in too); the
        stage is emptied. `WeightsError` when a tensor sent in pieces lacks one, or a piece of this
        call does not fit `model` (its whole tensors are the loader's to check)."""
        try:
            whole, pieces = _split(named)
            _check_pieces(model, pieces)
            self._gather(whole, pieces)
            return {**self._named, **whole, **{name: a.whole() for name, a in self._pieces.items()}}
        finally:
            self.clear()

    def clear(self) -> None:
        self._named = {}
        self._pieces = {}


FINITE_CHUNK = 1 << 24  # elements counted at once: bounds the count's scratch memory to 16 MB a tensor


@torch.no_grad()
def non_finite(tensor: torch.Tensor) -> int:
    """How many NaN or infinite values `tensor` holds (0 for integer and meta tensors).

    A sum is finite only if every term is (no sum of a NaN or an infinity is finite again), so a
    finite sum proves the tensor finite in one cheap pass (10x faster than `isfinite` on a CPU);
    only a non-finite sum, which an overflow could also cause, is counted element by element."""
    if not tensor.is_floating_point() or tensor.is_meta:
        return 0
    if bool(torch.isfinite(tensor.sum(dtype=torch.float32))):
        return 0
    flat = tensor.detach().reshape(-1)  # a view of a contiguous tensor, no copy
    return sum(int((~torch.isfinite(c)).sum()) for c in flat.split(FINITE_CHUNK))


@torch.no_grad()
def load_named_tensors(
    model: torch.nn.Module, named: Iterable[tuple[str, torch.Tensor]], share: bool = False, complete: bool = True
) -> None:
    """Load tensors into `model`'s parameters and buffers by name (cast to their dtype), after
    checking all of them (`check_named_tensors`): nothing changes unless everything fits.

    `share`: a parameter given a tensor of its own dtype and shape takes that tensor's storage
    instead of a copy (an in-process engine beside its trainer: no second copy of the weights, and
    the trainer's in-place updates need no copy at sync). Only for an engine that never generates
    while the trainer updates. A tensor that already is the parameter's storage is not copied.
    """
    named = dict(named)
    check_named_tensors(model, named, complete)
    targets = _targets(model)
    for name, tensor in named.items():
        target = targets[name]
        if target.data_ptr() == tensor.data_ptr() and target.dtype == tensor.dtype:
            continue  # already shared
        if (
            share
            and isinstance(target, torch.nn.Parameter)
            and (target.dtype, target.device)
            == (
                tensor.dtype,
                tensor.device,
            )
        ):
            target.data = tensor.detach()
        else:
            target.copy_(tensor)


def weights_checksum(named: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None) -> str:
    """A CRC-32 fingerprint of tensors by name (in name order), each as `dtype` when given: the
    trainer's weights cast to the engine's dtype fingerprint the same as the engine's after a load.
    About 40 ms for 270 MB."""
    crc = 0
    for name, t in sorted(named, key=lambda kv: kv[0]):
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        crc = tensor_crc(t, zlib.crc32(name.encode(), crc))
    return f"{crc:08x}"


class StreamingChecksum:
    """`weights_checksum` of tensors seen one at a time, in any order, without keeping them: each
    tensor's own CRC-32 (name and bytes) and length are kept, and at the end they are chained in
    name order with `crc32_combine` (what `zlib.crc32(b, crc)` would have given over the joined
    bytes)."""

    def __init__(self) -> None:
        self.parts: dict[str, tuple[int, int]] = {}

    def add(self, name: str, t: torch.Tensor) -> None:
        data = name.encode()
        self.parts[name] = (tensor_crc(t, zlib.crc32(data)), len(data) + t.numel() * t.element_size())

    def hexdigest(self) -> str:
        crc = 0
        for name in sorted(self.parts):
            part, length = self.parts[name]
            crc = crc32_combine(crc, part, length)
        return f"{crc:08x}"


def _gf2_times(mat: list[int], vec: int) -> int:
    out, i = 0, 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _gf2_square(mat: list[int]) -> list[int]:
    return [_gf2_times(mat, mat[n]) for n in range(32)]


def _zero_byte_operators(n: int = 48) -> list[list[int]]:
    """Operators over GF(2) that advance a CRC-32 over 2**k zero bytes, k = 0 .. n-1."""
    op = [0xEDB88320] + [1 << k for k in range(31)]  # one zero bit
    for _ in range(3):  # 2, 4, 8 bits: one byte
        op = _gf2_square(op)
    out = [op]
    for _ in range(n - 1):
        out.append(_gf2_square(out[-1]))
    return out


_ZEROS: list[list[int]] = []


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32 of A + B from crc1 = CRC-32(A), crc2 = CRC-32(B) and len2 = len(B) bytes (zlib's
    crc32_combine): crc1 advanced over len2 zero bytes, one precomputed operator per set bit of
    len2, then xored with crc2."""
    if not _ZEROS:
        _ZEROS.extend(_zero_byte_operators())
    k = 0
    while len2 > 0:
        if len2 & 1:
            crc1 = _gf2_times(_ZEROS[k], crc1)
        len2 >>= 1
        k += 1
    return crc1 ^ crc2


def tensor_crc(t: torch.Tensor, crc: int = 0) -> int:
    """CRC-32 of a tensor's bytes, continuing `crc`."""
    return zlib.crc32(t.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy(), crc)


def model_checksum(model: torch.nn.Module) -> str:
    """`weights_checksum` of a model's parameters (a tied weight once, under its first name)."""
    return weights_checksum(model.named_parameters())


def read_safetensors_dir(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of the `*.safetensors` files in a folder saved by `save_pretrained`. Raises
    `WeightsError` naming the file when one cannot be read."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise WeightsError(f"update_weights_from_disk: no *.safetensors in {path}")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            tensors.update(load_file(str(f)))
        except (SafetensorError, OSError, ValueError) as e:
            raise WeightsError(f"update_weights_from_disk: cannot read {f}: {e}") from e
    return tensors
