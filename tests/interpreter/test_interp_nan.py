"""The Triton merge kernel's NaN / -inf rules in Triton's interpreter (run by
tests/test_nan.py in a subprocess with ``TRITON_INTERPRET=1``)."""

import os

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 before triton is imported (see tests/test_nan.py)",
                allow_module_level=True)


import torch

import test_nan
from mlaprefill.kernels import merge_attention_states, merge_attention_states_torch


def test_triton_merge_nan_rules():
    o1, l1, o2, l2 = test_nan._merge_case()
    a_o, a_l = o1.clone(), l1.clone()
    merge_attention_states(a_o, a_l, o2, l2, use_kernel=True)
    test_nan._check_merge_rules(a_o, a_l, o1, l1)
    b_o, b_l = o1.clone(), l1.clone()
    merge_attention_states_torch(b_o, b_l, o2, l2)
    assert torch.allclose(a_o, b_o, atol=1e-6, equal_nan=True)
    assert torch.allclose(a_l, b_l, atol=1e-6, equal_nan=True)


def test_nan_and_inf_rule_of_the_triton_kernel():
    """The README's NaN and inf rule (tests/test_contract.py) for the ``mlaprefill`` backend's
    Triton kernel: 12 cases against the float64 reference."""
    import test_contract

    test_contract.check_nan_rule("mlaprefill", seeds=(1,), cols=(-1,))
