"""Process-wide choices of the torchfuse kernels, in the style of
torch.backends.cudnn: torchfuse.backends.conv and torchfuse.backends.matmul
(docs/options.md)."""

from torchfuse.backends import conv, matmul

__all__ = ["conv", "matmul"]
