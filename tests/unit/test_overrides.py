from dataclasses import replace

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
    [
        ("lrr=1", "unknown key"),
        ("lr", "expected key=value"),
        ("train_samples=abc", "expected int"),
        ("lr=-1", "negative"),
    ],
)
def test_bad_override_names_the_key(item, message):
    with pytest.raises(BadInput, match=message):
        parse_overrides([item])


def test_carbon_overrides_change_the_plans_estimate_and_profile():
    from appliance.hardware.carbon import BLOOM_JEAN_ZAY, DEFAULT_PROFILE
    from appliance.run_request import RunRequest, make_run_plan

    default = make_run_plan(RunRequest(corpus=[], hardware="cpu-laptop-2core")).run
    assert default.carbon.name == DEFAULT_PROFILE.name  # the stated default when the site says nothing
    bloom = make_run_plan(
        RunRequest(corpus=[], hardware="cpu-laptop-2core", overrides=parse_overrides(["carbon_profile=bloom-jean-zay"]))
    ).run
    assert (bloom.carbon.grid_g_per_kwh, bloom.pue) == (BLOOM_JEAN_ZAY.grid_g_per_kwh, BLOOM_JEAN_ZAY.pue)
    # same IT energy; carbon scales with PUE x intensity: 1.2 x 57 against 1.58 x 475
    assert bloom.co2_kg / default.co2_kg == pytest.approx((1.2 * 57) / (1.58 * 475))
    custom = make_run_plan(
        RunRequest(corpus=[], hardware="cpu-laptop-2core", overrides=parse_overrides(["grid_g_per_kwh=0", "pue=1.1"]))
    ).run
    assert custom.co2_kg == 0 and custom.pue == 1.1


def test_site_figures_of_a_hardware_profile_are_used():
    from appliance.run_request import RunRequest, make_run_plan

    run = make_run_plan(RunRequest(corpus=[], hardware="jean-zay-a100-48n", model="bloom-176b")).run
    assert (run.carbon.grid_g_per_kwh, run.pue) == (57.0, 1.2)


def test_unknown_carbon_profile_is_bad_input():
    from appliance.run_request import RunRequest, make_run_plan

    with pytest.raises(BadInput, match="carbon profile 'mars'"):
        make_run_plan(RunRequest(corpus=[], overrides=parse_overrides(["carbon_profile=mars"])))


def test_precision_is_the_plans_dtype():
    assert parse_overrides(["precision=fp16"]) == {"dtype": "fp16"}
    assert parse_overrides(["precision=bf16", "dtype=bf16"]) == {"dtype": "bf16"}
    with pytest.raises(BadInput, match="precision=fp8: must be one of bf16, fp16, fp32"):
        parse_overrides(["precision=fp8"])
    with pytest.raises(BadInput, match="precision=fp16 contradicts --set dtype=bf16"):
        parse_overrides(["dtype=bf16", "precision=fp16"])


def test_precision_override_reaches_the_plans_cost_model():
    """--set precision=fp16 on an A100 plans fp16 (no fp32 accumulation buffer), not bf16 relabelled afterwards."""
    from appliance.run_request import RunRequest, make_run_plan

    request = RunRequest(corpus=[], hardware="a100-80gb-x1", model="bloom-560m")
    default = make_run_plan(request)
    fp16 = make_run_plan(replace(request, overrides=parse_overrides(["precision=fp16"])))
    assert (default.train.dtype, default.device.dtype) == ("bf16", "bf16")
    assert (fp16.train.dtype, fp16.device.dtype) == ("fp16", "fp16")
    assert default.report.memory_breakdown_gb["grad_accumulation"] > 0
    assert fp16.report.memory_breakdown_gb["grad_accumulation"] == 0
