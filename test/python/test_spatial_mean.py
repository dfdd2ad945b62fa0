"""custom_spatial_mean: adaptive_avg_pool2d(x, [1, 1]) with a CUDA kernel for
dense channels-last inputs.  On the CPU, and for every input the kernel does
not take, it is the original op: values, strides, errors and derivatives.
The CUDA tests compare the kernel against a float64 reference under the
accuracy rule (cuda_utils), with the strides ATen gives."""

import pytest
import torch
import torch.nn.functional as F

import cuda_utils as cu

OP = torch.ops.torchfuse.custom_spatial_mean


def samples(device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(3)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(device, dtype)

    return [
        r(2, 5, 7, 3),
        r(2, 5, 7, 3).contiguous(memory_format=torch.channels_last),
        r(3, 4, 6),  # unbatched [C, H, W]
        r(2, 6, 1, 1).contiguous(memory_format=torch.channels_last),
        r(2, 5, 8, 9)[:, :, 1:7, ::2],  # sliced
        r(1, 3, 4, 4).permute(0, 1, 3, 2),
    ]


def kernel_takes(x):
    """The CUDA kernel's domain: dense NHWC strides, 16/32-bit floats."""
    if x.dim() != 4 or x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return False
    n, c, h, w = x.shape
    return x.stride() == (h * w * c, 1, w * c, c)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_cpu_is_the_original(dtype):
    for x in samples(dtype=dtype):
        want = F.adaptive_avg_pool2d(x, 1)
        got = OP(x)
        assert torch.equal(got, want)
        assert got.stride() == want.stride() and got.dtype == want.dtype


def test_opcheck_meta_and_derivatives():
    for x in samples():
        torch.library.opcheck(OP, (x,))
        meta = OP(x.to("meta"))
        want = F.adaptive_avg_pool2d(x, 1)
        assert meta.shape == want.shape and meta.stride() == want.stride()
    for x in samples(dtype=torch.float64):
        x = x.detach().requires_grad_()
        assert torch.autograd.gradcheck(OP, (x,))
        assert torch.autograd.gradgradcheck(lambda t: OP(t) ** 2, (x,))


def test_gradient_is_the_originals():
    for x in samples():
        a = x.detach().requires_grad_()
        b = x.detach().requires_grad_()
        gy = torch.randn(F.adaptive_avg_pool2d(x, 1).shape)
        OP(a).backward(gy)
        F.adaptive_avg_pool2d(b, 1).backward(gy)
        assert torch.equal(a.grad, b.grad) and a.grad.stride() == b.grad.stride()


def test_errors_are_the_originals_and_name_the_argument():
    with pytest.raises(RuntimeError, match="custom_spatial_mean.*self"):
        OP(None)
    with pytest.raises(Exception) as ours:
        OP(torch.randn(5))
    with pytest.raises(Exception) as atens:
        F.adaptive_avg_pool2d(torch.randn(5), 1)
    assert type(ours.value) is type(atens.value) and str(ours.value) == str(atens.value)


# ---- CUDA ---------------------------------------------------------------------

# (N, C, H, W): one pass (many images and channel tiles), split positions
# (few images, many positions), channels not a multiple of 32, one position.
CUDA_SHAPES = [(64, 96, 14, 14), (2, 32, 112, 112), (3, 45, 17, 23), (5, 70, 1, 1), (1, 8, 300, 1)]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("shape", CUDA_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cuda_kernel_against_float64(shape, dtype):
    g = torch.Generator(device="cuda").manual_seed(11)
    x = cu.signed_randn(*shape, dtype=dtype, generator=g).contiguous(memory_format=torch.channels_last)
    eager = F.adaptive_avg_pool2d(x, 1)
    cu.poison_allocator(cu.nbytes_of(eager) + [4 * x.numel()])
    got = OP(x)
    assert got.dtype == dtype and got.shape == eager.shape and got.stride() == eager.stride()
    ref = F.adaptive_avg_pool2d(x.double(), 1)
    cu.assert_close_to_reference(got, eager, ref, what=f"spatial mean {shape} {dtype}")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_nan_and_inf_as_eager():
    g = torch.Generator(device="cuda").manual_seed(12)
    x = cu.signed_randn(4, 40, 9, 9, dtype=torch.float32, generator=g)
    x = cu.inject_nonfinite(x, torch.Generator().manual_seed(5), count=6)
    x = x.contiguous(memory_format=torch.channels_last)
    eager = F.adaptive_avg_pool2d(x, 1)
    got = OP(x)
    assert torch.equal(cu.nonfinite_pattern(got), cu.nonfinite_pattern(eager))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_cuda_other_layouts_are_the_original(dtype):
    # NB: the dense channels-last inputs the kernel takes sum in another
    # order than ATen: test_cuda_kernel_against_float64 covers them.
    for x in samples(device="cuda", dtype=dtype):
        if kernel_takes(x):
            continue
        want = F.adaptive_avg_pool2d(x, 1)
        got = OP(x)
        assert torch.equal(got, want) and got.stride() == want.stride()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_kernel_needs_no_staging_buffer():
    # NB: ATen's mean of a channels-last input stages through a global
    # buffer (135 MiB for 64 such images); the kernel's workspace is at most
    # one float32 partial sum per output and split, and a split takes at
    # least 256 positions.
    x = torch.randn(4, 32, 112, 112, device="cuda", dtype=torch.float16)
    x = x.contiguous(memory_format=torch.channels_last)
    OP(x)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = OP(x)
    torch.cuda.synchronize()
    # NB: the caching allocator rounds each block up to 512 bytes, the
    # output's 256 bytes included.
    extra = torch.cuda.max_memory_allocated() - base - out.untyped_storage().nbytes()
    assert extra <= (112 * 112 // 256) * out.numel() * 4 + 512, extra
