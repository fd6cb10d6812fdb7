"""The README's NaN and inf rule for the Triton kernel of the ``mlaprefill`` backend, in Triton's
interpreter (run by tests/test_contract.py in a subprocess with ``TRITON_INTERPRET=1``)."""

import os

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 before triton is imported (see tests/test_contract.py)",
                allow_module_level=True)


import test_contract


def test_nan_and_inf_rule_of_the_triton_kernel():
    test_contract.check_nan_rule("mlaprefill", seeds=(1,))
