"""seqfuse.ops.amax against torch, on the CPU and the GPU."""
import pytest
import torch

import seqfuse

SHAPES = [(1,), (7,), (1000, 37), (3, 5, 129), (4097,), (64, 1024)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_amax_cpu(shape, dtype, seed):
    x = (torch.randn(shape) * 3).to(dtype)
    assert seqfuse.ops.amax(x).item() == x.float().abs().max().item()


def test_amax_cpu_strided(seed):
    x = torch.randn(50, 60)[::3, 5:].t()
    assert seqfuse.ops.amax(x).item() == x.abs().max().item()


def test_amax_nan_propagates():
    x = torch.tensor([1.0, float("nan"), -5.0])
    assert torch.isnan(seqfuse.ops.amax(x))


def test_amax_inf():
    x = torch.tensor([1.0, float("-inf"), 5.0])
    assert seqfuse.ops.amax(x).item() == float("inf")


def test_amax_out_argument():
    out = torch.full((1,), -1.0)
    r = seqfuse.ops.amax(torch.tensor([-3.0, 2.0]), out=out)
    assert r is out and out.item() == 3.0


def test_amax_bad_dtype():
    with pytest.raises(TypeError, match="amax: argument 'x' must have dtype float32, float16 or bfloat16, got torch.int32"):
        seqfuse.ops.amax(torch.ones(3, dtype=torch.int32))


def test_amax_bad_out_dtype_from_c():
    with pytest.raises(TypeError, match="amax: argument 'out' must have dtype float32, got bfloat16"):
        seqfuse._C.amax(torch.ones(3), torch.empty((), dtype=torch.bfloat16))


def test_amax_bad_out_size_from_c():
    with pytest.raises(ValueError, match="amax: argument 'out' must have 1 element\\(s\\), got 2"):
        seqfuse._C.amax(torch.ones(3), torch.empty(2))


@pytest.mark.cuda
@pytest.mark.parametrize("shape", SHAPES + [(8192, 8193), (3, 0)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_amax_cuda_matches_cpu_and_torch(shape, dtype, seed):
    x = (torch.randn(shape, device="cuda") * 3).to(dtype)
    out = torch.full((), float("nan"), device="cuda")  # poisoned
    seqfuse.ops.amax(x, out=out)
    cpu = seqfuse.ops.amax(x.cpu())
    ref = x.float().abs().max() if x.numel() else torch.zeros(())
    assert out.item() == cpu.item() == ref.item()


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_amax_cuda_unaligned_and_strided(dtype, seed):
    base = torch.randn(100_003, device="cuda").to(dtype)
    for x in (base[1:], base[3:-5], base[::7], base[:99_000].view(990, 100)[:, 1::2]):
        assert seqfuse.ops.amax(x).item() == x.float().abs().max().item()


@pytest.mark.cuda
def test_amax_cuda_nan():
    x = torch.randn(1 << 20, device="cuda")
    x[12345] = float("nan")
    assert torch.isnan(seqfuse.ops.amax(x)).item()


@pytest.mark.cuda
def test_amax_runs_on_current_stream():
    s = torch.cuda.Stream()
    x = torch.randn(1 << 22, device="cuda")
    with torch.cuda.stream(s):
        y = x * 2  # producer work on s
        r = seqfuse.ops.amax(y)  # must be ordered after it, on s
    s.synchronize()
    assert r.item() == (x * 2).abs().max().item()


@pytest.mark.cuda
def test_amax_cuda_graph_capture():
    x = torch.randn(1 << 16, device="cuda")
    out = torch.empty((), device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        seqfuse.ops.amax(x, out=out)  # warm up outside capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        seqfuse.ops.amax(x, out=out)
    x.copy_(torch.randn_like(x) * 7)
    g.replay()
    torch.cuda.synchronize()
    assert out.item() == x.abs().max().item()
