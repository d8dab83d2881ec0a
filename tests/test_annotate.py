"""annotate: tags live with the tensor and survive shard and replace."""

from __future__ import annotations

import re

import pytest
from torch import nn

import torchloom as tl
from tests import tiny


def test_tag_is_readable_and_recorded():
    model = tiny.bert()
    sch = tl.create_schedule(model)
    sch["bert.encoder.layer.*.attention.self.query"].annotate("weight", "colwise", True)
    for layer in model.bert.encoder.layer:
        assert layer.attention.self.query.weight.colwise is True
        assert tl.get_meta(layer.attention.self.query.weight).tags == {"colwise": True}
    assert len(sch.recipe) == 2


def test_dotted_parameter_name_and_buffer():
    model = tiny.bert()
    sch = tl.create_schedule(model)
    sch["bert"].annotate("embeddings.word_embeddings.weight", "vocab", 128)
    assert model.bert.embeddings.word_embeddings.weight.vocab == 128
    sch["bert.embeddings"].annotate("position_ids", "kind", "index")
    assert model.bert.embeddings.position_ids.kind == "index"


def test_tag_survives_shard_and_replace():
    model = nn.Sequential(nn.Sequential(nn.Linear(4, 4)))
    sch = tl.create_schedule(model)
    sch["0.0"].annotate("weight", "owner", "a")
    sch["0.0"].shard("weight", 0)
    sch["0"].replace(lambda old: nn.Sequential(old[0], nn.ReLU()))
    assert model[0][0].weight.owner == "a"


def test_annotate_errors():
    sch = tl.create_schedule(nn.Sequential(nn.Linear(2, 2)))
    with pytest.raises(tl.AnnotateError, match=re.escape(
            "sch['0'].annotate(...): a tag key must be a public identifier")):
        sch["0"].annotate("weight", "_private", 1)
    with pytest.raises(tl.AnnotateError, match="a tag key must be a public identifier"):
        sch["0"].annotate("weight", "not an identifier", 1)
    with pytest.raises(tl.AnnotateError, match=re.escape("tag key 'grad' would hide torch.Tensor.grad")):
        sch["0"].annotate("weight", "grad", 1)
    with pytest.raises(tl.PathError, match="Linear has no parameter or buffer 'w'"):
        sch["0"].annotate("w", "tag", 1)
    with pytest.raises(tl.PathError, match="ReLU has no parameter or buffer 'weight'"):
        tl.create_schedule(nn.Sequential(nn.ReLU()))["0"].annotate("weight", "tag", 1)
