"""Shared fixtures of the Python tests: loads the ops and seeds every test."""

import pytest
import torch

import torchfuse  # noqa: F401  (registers torch.ops.torchfuse.custom_*)


@pytest.fixture(autouse=True)
def seed():
    """Every test starts from the same random state, so failures reproduce."""
    torch.manual_seed(0)
    yield


@pytest.fixture
def no_texpr_fuser():
    """TorchScript's NNC fuser off for the test, and back as it was after."""
    old = torch._C._jit_texpr_fuser_enabled()
    torch._C._jit_set_texpr_fuser_enabled(False)
    yield
    torch._C._jit_set_texpr_fuser_enabled(old)


@pytest.fixture
def ops():
    """The torchfuse op namespace, ``torch.ops.torchfuse``."""
    return torch.ops.torchfuse
