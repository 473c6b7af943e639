"""The torch floor of torchrun runs names every FSDP2 method the code needs that is new in torch 2.8, and the
installed torch has them.

    python -m pytest tests/test_torch_floor.py -q
"""
import re
from pathlib import Path

import pytest
from torch.distributed.fsdp import FSDPModule

from infra import scale

ROOT = Path(__file__).resolve().parents[1]


def test_the_refusal_names_every_fsdp_method_of_the_floor():
    # every FSDPModule setter infra/scale.py calls, read from its source
    called = set(re.findall(r"\bm\.(set_\w+)\(", (ROOT / "infra" / "scale.py").read_text()))  # m: an FSDPModule
    assert called == set(scale.FSDP_METHODS) == {"set_reshard_after_forward", "set_gradient_divide_factor",
                                                 "set_force_sum_reduction_for_comms"}
    assert all(hasattr(FSDPModule, m) for m in called)
    with pytest.raises(ValueError) as e:
        scale.check_torch("2.7.1+cu126")
    assert all(f".{m}" in str(e.value) for m in called) and "\n" not in str(e.value)
