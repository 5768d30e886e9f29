"""A profile and tied weights: a plan names a tied tensor by its first name, which a
model of the same shapes with the weights untied also has (a hostile review's: such a
profile loaded there prefetched the embedding, and lm_head never)."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from l2prefetch import PlanEntry  # noqa: E402
from l2prefetch.profile import (ProfileMismatchError, load_profile, profile_document,  # noqa: E402
                                save_profile, step_record, versions)

DEVICE = {"name": "X", "sm": 90, "sm_count": 1, "l2_bytes": 1, "driver_version": 1}


class LM(torch.nn.Module):
    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(64, 16)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(16, 16)])
        self.lm_head = torch.nn.Linear(16, 64, bias=False)
        if tied:
            self.lm_head.weight = self.embed.weight


def _saved(tmp_path, model, weight):
    document = profile_document(
        model, [PlanEntry("p", 0, [1], (weight,))], {"p": [("layers.0", 0)]}, batches=[1],
        device=DEVICE, versions=versions(), step=step_record(False), tuning={}, results=[])
    path = tmp_path / "p.json"
    save_profile(path, document)
    return path


def test_a_profile_of_a_tied_model_refuses_the_untied_one(tmp_path):
    tied = LM(tied=True)
    path = _saved(tmp_path, tied, tied.lm_head.weight)
    data = json.loads(path.read_text())
    assert list(data["model"]["weights"]) == ["embed.weight"]      # its first name
    assert data["model"]["tied"] == {"embed.weight": ["lm_head.weight"]}
    loaded = load_profile(path, tied, check_device=False)
    assert loaded.plan[0].weights[0] is tied.lm_head.weight
    with pytest.raises(ProfileMismatchError, match=r"tuned on another model \(embed.weight is "
                                                   r"also \['lm_head.weight'\] in the profile "
                                                   r"\(tied\), not here\)"):
        load_profile(path, LM(tied=False), check_device=False)


def test_an_untied_models_profile_records_nothing_tied_and_loads_on_a_tied_one(tmp_path):
    """Untied at tuning, tied here: the plan's name still reads the bytes it tuned."""
    untied = LM(tied=False)
    path = _saved(tmp_path, untied, untied.lm_head.weight)
    assert "tied" not in json.loads(path.read_text())["model"]   # older releases read it
    tied = LM(tied=True)
    assert load_profile(path, tied, check_device=False).plan[0].weights[0] is tied.embed.weight


def test_a_profile_without_tied_loads_as_before_and_a_bad_one_is_refused(tmp_path):
    tied = LM(tied=True)
    path = _saved(tmp_path, tied, tied.lm_head.weight)
    data = json.loads(path.read_text())
    del data["model"]["tied"]                      # written before it was recorded
    path.write_text(json.dumps(data))
    load_profile(path, LM(tied=False), check_device=False)
    for bad, words in (({"nope.weight": ["x"]}, r"'model.tied' names 'nope.weight', which is "
                                                r"not in 'model.weights'"),
                       ({"embed.weight": []}, r"'model.tied'\['embed.weight'\] must be a "
                                              r"non-empty list"),
                       ({"embed.weight": ["embed.weight"]}, r"must be a non-empty list")):
        data["model"]["tied"] = bad
        path.write_text(json.dumps(data))
        with pytest.raises(ValueError, match=words):
            load_profile(path, tied, check_device=False)
