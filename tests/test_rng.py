"""Which torch versions let breakgraph arm CUDA generators, and what a user is told when it cannot."""

import warnings

import pytest

from breakgraph import recorder
from breakgraph.rng import armable


@pytest.mark.parametrize(
    "version, expected",
    [
        ("2.8.0", True),
        ("2.11.0+cu130", True),
        ("2.11.1", True),
        ("2.11.0a0+git1234abc", True),
        ("2.12.0", False),
        ("2.12.0.dev20260301+cu130", False),  # nightlies of 2.12 already key generator state by capture
        ("2.12.0rc1", False),
        ("2.13.0+cpu", False),
        ("2.14.1", False),
        ("3.0.0", False),
    ],
)
def test_generators_are_armable_before_torch_2_12_only(version, expected):
    assert armable(version, graph_has_register_generator_state=True) is expected


def test_a_torch_without_register_generator_state_is_never_armable():
    assert armable("2.11.0", graph_has_register_generator_state=False) is False


def test_the_fallback_is_explained_once_in_a_users_words(monkeypatch):
    monkeypatch.setattr(recorder, "_warned_uncooperative", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        recorder._warn_uncooperative()
        recorder._warn_uncooperative()
    assert len(caught) == 1
    message = str(caught[0].message)
    for words in ("random ops (dropout, randn, ...) run as eager breaks", "torch 2.12", "fresh numbers", "random_ops='break'"):
        assert words in message, message
