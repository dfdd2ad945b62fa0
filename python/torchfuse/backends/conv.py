"""Choices of the convolution ops' CUDA kernels, process-wide
(torchfuse::backends::conv() in C++; docs/options.md).

    torchfuse.backends.conv.channels_last_route  'auto' (default), 'never' or 'always'
    torchfuse.backends.conv.allow_implicit_gemm  True (default) or False
    torchfuse.backends.conv.allow_direct         True (default) or False
    torchfuse.backends.conv.nchw_conversion      'auto' (default) or 'separate'
    torchfuse.backends.conv.conversion_lookahead 0 (default) or 1 to 64
    torchfuse.backends.conv.cudnn_fusion         'auto' (default), 'never' or 'always'

    with torchfuse.backends.conv.flags(allow_implicit_gemm=False):
        ...

channels_last_route='always', nchw_conversion='separate' and a nonzero
conversion_lookahead force a strategy whatever the problem's size or
precision: they are for tests and measurements.  So does
cudnn_fusion='always': custom_conv_add_act's convolution and epilogue run as
one cuDNN graph wherever cuDNN has a plan for it; 'auto' times the fused
plans against the convolution and epilogue on each problem's first call and
keeps the fastest.
"""

import sys

from torchfuse import _C
from torchfuse.backends._options import Option, boolean, choice, int_range, install

install(sys.modules[__name__], {
    "channels_last_route": Option("channels_last_route", _C._get_conv_channels_last_route,
                                  _C._set_conv_channels_last_route, choice("auto", "never", "always")),
    "allow_implicit_gemm": Option("allow_implicit_gemm", _C._get_conv_allow_implicit_gemm,
                                  _C._set_conv_allow_implicit_gemm, boolean),
    "allow_direct": Option("allow_direct", _C._get_conv_allow_direct, _C._set_conv_allow_direct, boolean),
    "nchw_conversion": Option("nchw_conversion", _C._get_conv_nchw_conversion,
                              _C._set_conv_nchw_conversion, choice("auto", "separate")),
    "conversion_lookahead": Option("conversion_lookahead", _C._get_conv_conversion_lookahead,
                                   _C._set_conv_conversion_lookahead, int_range(1, 64, "the kernel's choice")),
    "cudnn_fusion": Option("cudnn_fusion", _C._get_conv_cudnn_fusion, _C._set_conv_cudnn_fusion,
                           choice("auto", "never", "always")),
})
