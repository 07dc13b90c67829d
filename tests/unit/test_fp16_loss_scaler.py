"""The device loss scaler (parallel/step/fp16_step.py) against DeepSpeed's DynamicLossScaler, the rule it copies: the
same scale, hysteresis and counters after every step of scripted overflow sequences, in every configuration of the
rule's branches (hysteresis 1 and 2, consecutive hysteresis, the minimum scale, a growth window)."""

from __future__ import annotations

import itertools

import pytest
import torch
from deepspeed.runtime.fp16 import loss_scaler

from appliance.parallel.step.fp16_step import DeviceLossScaler
from appliance.parallel.step.precision import SCALER_FIELDS, load_loss_scaler_state, loss_scaler_state

OVER, CLEAN = True, False  # an overflow step, a clean one
# "o" an overflow, "." a clean step: overflows absorbed by the hysteresis, halvings down to the minimum scale and more
# overflows there, doublings after each window of clean steps (3: DeepSpeed grows on the 4th clean step after an
# overflow, torch's GradScaler on the 3rd).
SEQUENCE = [step == "o" for step in "ooo.......o.oooooooo........o.o...."]


def _deepspeeds(*, init_scale: float, delayed_shift: int, consecutive: bool) -> loss_scaler.DynamicLossScaler:
    return loss_scaler.DynamicLossScaler(
        init_scale=init_scale, scale_window=3, min_scale=1, delayed_shift=delayed_shift,
        consecutive_hysteresis=consecutive, raise_error_at_min_scale=False,
    )  # fmt: skip


def _state(scaler: object) -> dict[str, float]:
    return {key: float(getattr(scaler, attr)) for key, attr in SCALER_FIELDS.items()}


@pytest.mark.parametrize("delayed_shift", [1, 2, 3])
@pytest.mark.parametrize("consecutive", [False, True])
def test_the_device_rule_is_deepspeeds(delayed_shift: int, consecutive: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loss_scaler.dist, "get_rank", lambda: 1)  # DeepSpeed's rule logs on rank 0 only
    theirs = _deepspeeds(init_scale=16.0, delayed_shift=delayed_shift, consecutive=consecutive)
    ours = DeviceLossScaler(theirs, torch.device("cpu"))
    scales = []
    for step, overflow in enumerate(SEQUENCE):
        ran_at = float(theirs.cur_scale)
        theirs.update_scale(overflow)
        ours.update_scale(torch.tensor(float(overflow)))
        assert _state(ours) == _state(theirs), (step, _state(ours), _state(theirs))
        assert ours.last_step.tolist() == [ran_at, float(overflow and ran_at > 1)]
        scales.append(ran_at)
    # The sequence reaches the minimum scale and grows again: every branch of the rule ran.
    assert min(scales) == 1.0 and any(later > earlier for earlier, later in itertools.pairwise(scales))


def test_the_loss_is_multiplied_by_the_device_scale() -> None:
    ours = DeviceLossScaler(_deepspeeds(init_scale=2.0**12, delayed_shift=2, consecutive=False), torch.device("cpu"))
    loss = torch.tensor(0.75, requires_grad=True)
    scaled = ours.scale_loss(loss)
    scaled.backward()
    assert scaled.item() == 0.75 * 2**12 and loss.grad is not None and loss.grad.item() == 2**12
    assert ours.loss_scale is ours.cur_scale and ours.cur_scale.dtype == torch.float32


def test_a_checkpoint_moves_between_deepspeeds_scaler_and_the_device_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """The manifest's state from DeepSpeed's scaler loads into the device one (in place) and back, and both then
    continue alike."""
    monkeypatch.setattr(loss_scaler.dist, "get_rank", lambda: 1)
    theirs = _deepspeeds(init_scale=2.0**12, delayed_shift=2, consecutive=False)
    for overflow in [OVER, OVER, CLEAN, CLEAN, CLEAN, CLEAN, OVER]:
        theirs.update_scale(overflow)

    class Holder:  # what precision.py reads: the optimizer's loss_scaler
        def __init__(self, scaler: object) -> None:
            self.loss_scaler = scaler

    ours = DeviceLossScaler(_deepspeeds(init_scale=1.0, delayed_shift=2, consecutive=False), torch.device("cpu"))
    tensors = [getattr(ours, attr) for attr in SCALER_FIELDS.values()]
    load_loss_scaler_state(Holder(ours), loss_scaler_state(Holder(theirs)))
    assert _state(ours) == _state(theirs) and all(
        getattr(ours, attr) is t for attr, t in zip(SCALER_FIELDS.values(), tensors, strict=True)
    )
    back = _deepspeeds(init_scale=1.0, delayed_shift=2, consecutive=False)
    load_loss_scaler_state(Holder(back), loss_scaler_state(Holder(ours)))
    for overflow in [CLEAN, CLEAN, CLEAN, OVER, OVER]:
        theirs.update_scale(overflow)
        back.update_scale(overflow)
        ours.update_scale(torch.tensor(overflow))
        assert _state(ours) == _state(theirs) == _state(back)
