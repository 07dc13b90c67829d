"""parallel/step/host_reads.py's counter catches each way a step makes the host wait for the device, and counts nothing
for work that stays there.

Every branch gets a positive control: a step that reads its loss (`.item()`, `float()`, `if loss:`), a data-dependent
shape (`nonzero`, `masked_select`, indexing or assigning by a boolean mask), a comparison answered on the host
(`equal`), `tolist()`, and copies from the device into host memory (`.cpu()`, `.to("cpu")`, `host.copy_(device)`).
The copies need a device that is not the host: a GPU where there is one, else CUDA tensors that hold no data (torch's
FakeTensorMode: the ops dispatch as on a GPU, shapes and devices included, and nothing runs).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from appliance.parallel.step.host_reads import counting_host_reads


@contextmanager
def _cuda() -> Iterator[None]:
    if torch.cuda.is_available():
        yield
        return
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        yield


def test_a_step_that_reads_its_loss_is_caught() -> None:
    weights = torch.randn(8, requires_grad=True)
    with counting_host_reads() as reads:
        loss = (weights * 2).square().mean()
        loss.backward()
        loss.item()  # e.g. to log it
        float(loss.detach())
        if loss > 0:
            pass
    assert reads.counts["aten::_local_scalar_dense"] == 3, dict(reads.counts)


def test_data_dependent_shapes_host_comparisons_and_tolist_are_caught() -> None:
    x = torch.tensor([0.0, 1.0, 2.0])
    with counting_host_reads() as reads:
        x.nonzero()
        x.masked_select(x > 0)
        x[x > 0]  # boolean-mask indexing sizes its result on the host
        x[x > 0] = 0.0
        x[torch.tensor([0, 2])]  # indexing by positions does not
        torch.equal(x, x)
        x.tolist()
    assert dict(reads.counts) == {"aten::nonzero": 1, "aten::masked_select": 1, "boolean_index": 2,
                                  "aten::equal": 1, "tolist": 1}  # fmt: skip


def test_copies_from_the_device_to_the_host_are_caught() -> None:
    host = torch.empty(4)
    with _cuda():
        on_device = torch.ones(4, device="cuda")
        with counting_host_reads() as reads:
            on_device.cpu()
            on_device.to("cpu")
            host.copy_(on_device)
    assert reads.counts["device_to_host"] == 3, dict(reads.counts)


def test_work_on_the_device_is_not_counted() -> None:
    """(Copies from the host to the device are not counted either: tests/distributed/test_capturable_step.py issues
    steps whose batches are copied in, on CPU.)"""
    with _cuda(), counting_host_reads() as reads:
        on_device = torch.ones(4, device="cuda")
        on_device.mul_(2).add_(torch.ones(4, device="cuda"))
        on_device.sum().sqrt()
        on_device.to(torch.bfloat16)  # a copy that stays on the device
    assert reads.total == 0, dict(reads.counts)
