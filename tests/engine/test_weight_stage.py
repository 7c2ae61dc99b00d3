"""`WeightStage` puts a tensor sent in pieces (NAME@OFFSET/SHAPE, see tidal.engine.weights)
together over the calls of one update, and refuses, naming the tensor and dropping everything
staged, a piece that is missing, sent twice, overlapping, of another tensor's shape or dtype, or
not the model's."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model

from tidal.engine.weights import WeightsError, WeightStage, parse_piece, piece_name

EMBED = "model.embed_tokens.weight"  # 320 x 64 in the tiny model: 20480 elements


def pieces(t: torch.Tensor, step: int, name: str = EMBED) -> list[tuple[str, torch.Tensor]]:
    flat = t.reshape(-1)
    return [(piece_name(name, i, t.shape), flat[i : i + step].clone()) for i in range(0, flat.numel(), step)]


@pytest.fixture
def model():
    return make_model()


def test_piece_names_round_trip_and_plain_names_are_not_pieces():
    assert piece_name(EMBED, 7077888, (49152, 576)) == f"{EMBED}@7077888/49152x576"
    assert parse_piece(f"{EMBED}@7077888/49152x576") == (EMBED, 7077888, (49152, 576))
    assert parse_piece("a@b/c@5/9") == ("a@b/c", 5, (9,))
    for plain in (EMBED, "w@x", "w@1/", "w@1/2x", "w@-1/4"):
        assert parse_piece(plain) is None


def test_pieces_over_several_calls_make_the_tensor(model):
    embed = torch.randn(320, 64)
    parts = pieces(embed, 6000)  # 4 pieces, the last short
    stage = WeightStage()
    stage.add(model, dict(parts[2:3]))
    stage.add(model, dict([parts[0], ("model.norm.weight", torch.ones(64))]))
    stage.add(model, dict(parts[3:]))
    out = stage.take(model, dict(parts[1:2]))  # the order of arrival does not matter
    assert sorted(out) == [EMBED, "model.norm.weight"] and torch.equal(out[EMBED], embed)
    assert stage.take(model, {}) == {}  # emptied


def test_a_missing_piece_is_named_at_the_last_call_and_nothing_is_kept(model):
    parts = pieces(torch.randn(320, 64), 6000)
    stage = WeightStage()
    stage.add(model, dict([parts[0], parts[2]]))
    with pytest.raises(WeightsError) as err:
        stage.take(model, dict(parts[3:]))
    assert str(err.value) == (
        f"update_weights: {EMBED} (320x64, torch.float32) is missing elements [6000, 12000) of its 20480 "
        "(3 piece(s) arrived): a piece was not sent; send the whole update again"
    )
    assert stage.take(model, {}) == {}


@pytest.mark.parametrize(
    "second,message",
    [
        ("same", "overlaps elements [0, 6000), received already: every piece is sent once"),
        ("overlapping", "at elements [5000, 11000) overlaps elements [0, 6000)"),
        ("past the end", "at elements [20000, 26000) runs past its 20480 elements"),
        ("another dtype", "says 320x64, torch.float64; an earlier one said 320x64, torch.float32"),
        ("whole", f"{EMBED} came both whole and in pieces; send it one way"),
    ],
)
def test_a_piece_that_does_not_fit_the_others_is_refused_and_the_stage_dropped(model, second, message):
    embed = torch.randn(320, 64)
    first = pieces(embed, 6000)[0]
    bad = {
        "same": dict([first]),
        "overlapping": {piece_name(EMBED, 5000, (320, 64)): torch.zeros(6000)},
        "past the end": {piece_name(EMBED, 20000, (320, 64)): torch.zeros(6000)},
        "another dtype": {piece_name(EMBED, 6000, (320, 64)): torch.zeros(10, dtype=torch.float64)},
        "whole": {EMBED: embed},
    }[second]
    stage = WeightStage()
    stage.add(model, {**dict([first]), "model.norm.weight": torch.ones(64)})
    with pytest.raises(WeightsError, match=EMBED) as err:
        stage.add(model, bad)
    assert message in str(err.value)
    assert stage.take(model, {}) == {}  # the earlier call's tensors are gone too


def test_a_piece_of_a_shape_or_name_the_model_lacks_or_not_finite_is_refused_before_a_buffer_is_made(model):
    stage = WeightStage()
    with pytest.raises(WeightsError, match=r"model.embed_tokens.weight has shape \(100000, 100000\), the engine's"):
        stage.add(model, {piece_name(EMBED, 0, (100000, 100000)): torch.zeros(4)})
    with pytest.raises(WeightsError, match="the engine's model has no parameter 'nope'"):
        stage.take(model, {piece_name("nope", 0, (8,)): torch.zeros(4)})
    nan = torch.zeros(6000)
    nan[7] = float("nan")
    with pytest.raises(WeightsError, match=f"{EMBED} holds 1 NaN or infinite value.* elements \\[6000, 12000\\)"):
        stage.add(model, {piece_name(EMBED, 6000, (320, 64)): nan})
