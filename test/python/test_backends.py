"""torchfuse.backends.conv and torchfuse.backends.matmul: the process-wide
options of the kernels (include/torchfuse/backends.h).  CPU-only: the values
round-trip through the C++ options (read back by _C's getters), bad values
raise errors that name the option, what it expects and what it got, and
flags() restores every option, also when its block raises."""

import re
import threading

import pytest

import torchfuse
from torchfuse import _C

conv = torchfuse.backends.conv
matmul = torchfuse.backends.matmul

CONV_DEFAULTS = {"channels_last_route": "auto", "allow_implicit_gemm": True, "allow_direct": True,
                 "nchw_conversion": "auto", "conversion_lookahead": 0, "cudnn_fusion": "auto"}
CPP_GETTERS = {"channels_last_route": _C._get_conv_channels_last_route,
               "allow_implicit_gemm": _C._get_conv_allow_implicit_gemm,
               "allow_direct": _C._get_conv_allow_direct,
               "nchw_conversion": _C._get_conv_nchw_conversion,
               "conversion_lookahead": _C._get_conv_conversion_lookahead,
               "cudnn_fusion": _C._get_conv_cudnn_fusion}


@pytest.fixture(autouse=True)
def _restore():
    with conv.flags(), matmul.flags():
        yield


def test_defaults():
    assert {n: getattr(conv, n) for n in CONV_DEFAULTS} == CONV_DEFAULTS
    assert matmul.autotune is True


@pytest.mark.parametrize("name,value", [
    ("channels_last_route", "never"), ("channels_last_route", "always"),
    ("allow_implicit_gemm", False), ("allow_direct", False),
    ("nchw_conversion", "separate"), ("conversion_lookahead", 1), ("conversion_lookahead", 64),
    ("cudnn_fusion", "never"), ("cudnn_fusion", "always"),
])
def test_conv_round_trip(name, value):
    """A value set in Python is the C++ option's value, and reads back."""
    setattr(conv, name, value)
    assert getattr(conv, name) == value
    assert CPP_GETTERS[name]() == value
    # the others are untouched
    for other, default in CONV_DEFAULTS.items():
        if other != name:
            assert getattr(conv, other) == default


def test_matmul_round_trip():
    matmul.autotune = False
    assert matmul.autotune is False and _C._get_matmul_autotune() is False
    matmul.autotune = True
    assert _C._get_matmul_autotune() is True


@pytest.mark.parametrize("name,value,error,message", [
    ("channels_last_route", "yes", ValueError,
     "torchfuse.backends.conv.channels_last_route: expected 'auto', 'never' or 'always', got 'yes'"),
    ("channels_last_route", None, TypeError,
     "torchfuse.backends.conv.channels_last_route: expected 'auto', 'never' or 'always', "
     "got the NoneType None"),
    ("nchw_conversion", "inside", ValueError,
     "torchfuse.backends.conv.nchw_conversion: expected 'auto' or 'separate', got 'inside'"),
    ("allow_implicit_gemm", "never", TypeError,
     "torchfuse.backends.conv.allow_implicit_gemm: expected True or False, got the str 'never'"),
    ("allow_direct", 0, TypeError,
     "torchfuse.backends.conv.allow_direct: expected True or False, got the int 0"),
    ("conversion_lookahead", 65, ValueError,
     "torchfuse.backends.conv.conversion_lookahead: expected 0 (the kernel's choice) or an int "
     "from 1 to 64, got 65"),
    ("conversion_lookahead", -1, ValueError, "from 1 to 64, got -1"),
    ("conversion_lookahead", "3", TypeError, "got the str '3'"),
    ("conversion_lookahead", True, TypeError, "got the bool True"),
    ("cudnn_fusion", "on", ValueError,
     "torchfuse.backends.conv.cudnn_fusion: expected 'auto', 'never' or 'always', got 'on'"),
    ("cudnn_fusion", False, TypeError, "got the bool False"),
])
def test_conv_rejects(name, value, error, message):
    """A bad value raises, naming the option, and changes nothing."""
    with pytest.raises(error, match=re.escape(message)):
        setattr(conv, name, value)
    assert getattr(conv, name) == CONV_DEFAULTS[name]


def test_matmul_rejects():
    with pytest.raises(TypeError, match="torchfuse.backends.matmul.autotune: expected True or False, got the int 0"):
        matmul.autotune = 0
    assert matmul.autotune is True


def test_misspelt_option():
    """An unknown attribute would otherwise be set silently and change nothing."""
    with pytest.raises(AttributeError, match="torchfuse.backends.conv has no option 'channels_last'"):
        conv.channels_last = "never"
    with pytest.raises(AttributeError, match="the options are autotune"):
        matmul.auto_tune = False


def test_cpp_setters_check_too():
    """The C++ options check what reaches them by another way than the module."""
    with pytest.raises(RuntimeError, match="expected images to be 0 .* or from 1 to 64, got 65"):
        _C._set_conv_conversion_lookahead(65)
    with pytest.raises(RuntimeError, match='expected channels_last_route to be one of auto, never, always, got "yes"'):
        _C._set_conv_channels_last_route("yes")
    with pytest.raises(RuntimeError, match='expected cudnn_fusion to be one of auto, never, always, got "on"'):
        _C._set_conv_cudnn_fusion("on")
    assert conv.conversion_lookahead == 0 and conv.channels_last_route == "auto" and conv.cudnn_fusion == "auto"


def test_flags_sets_and_restores():
    conv.allow_direct = False  # state before the block, not the default
    with conv.flags(channels_last_route="always", conversion_lookahead=3, allow_implicit_gemm=None):
        assert conv.channels_last_route == "always" and conv.conversion_lookahead == 3
        assert conv.allow_implicit_gemm is True  # None: unchanged
        conv.nchw_conversion = "separate"  # set inside the block: restored too
    assert conv.channels_last_route == "auto" and conv.conversion_lookahead == 0
    assert conv.nchw_conversion == "auto"
    assert conv.allow_direct is False


def test_flags_restores_after_an_error():
    with pytest.raises(KeyError):
        with matmul.flags(autotune=False):
            assert matmul.autotune is False
            raise KeyError("inside")
    assert matmul.autotune is True


def test_flags_checks_every_value_first():
    """A bad value in flags() raises before any option is set."""
    with pytest.raises(ValueError, match="torchfuse.backends.conv.flags: channels_last_route: expected"):
        with conv.flags(allow_direct=False, channels_last_route="sometimes"):
            pass
    assert conv.allow_direct is True
    with pytest.raises(TypeError, match="unknown option 'direct'"):
        with conv.flags(direct=False):
            pass


def test_visible_from_other_threads():
    """Process-wide, as cuDNN's flags: a value set on one thread is the one
    another thread reads."""
    conv.channels_last_route = "never"
    seen = []
    t = threading.Thread(target=lambda: seen.append(_C._get_conv_channels_last_route()))
    t.start()
    t.join()
    assert seen == ["never"]
