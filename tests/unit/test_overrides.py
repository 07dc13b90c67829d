import pytest

from appliance.errors import BadInput
from appliance.overrides import parse_overrides


def test_known_keys_are_typed():
    assert parse_overrides(["lr=3e-4", "train_samples=64", "dtype=fp32"]) == {
        "lr": 3e-4,
        "train_samples": 64,
        "dtype": "fp32",
    }


@pytest.mark.parametrize(
    ("item", "message"),
    [("lrr=1", "unknown key"), ("lr", "expected key=value"), ("train_samples=abc", "expected int"),
     ("lr=-1", "negative")],
)
def test_bad_override_names_the_key(item, message):
    with pytest.raises(BadInput, match=message):
        parse_overrides([item])
