"""cast + transpose + amax of bf16 matrices to FP8 (E4M3): the kernel FP8
training runs on every activation and weight.  seqfuse's fused kernel beside
the device copy ceiling and the same work written in torch.

Rows per size (4096^2, 8192^2, 16384^2):
  seqfuse   ops.cast_transpose_fp8: one pass writes the FP8 copy, the
            transposed FP8 copy and folds max|x| into amax.
  copy      torch tensor.copy_ of the same bytes (a bf16 matrix: 2 bytes read
            and 2 written per element, which is what the fused kernel moves:
            2 read, 1 + 1 written).
  torch     x.abs().amax(); (x * scale).to(float8_e4m3fn); .t().contiguous().
Bandwidth counts bytes read and written (4 per element).  Also checks the
fused kernel's output against torch's where torch's is finite.
"""
import torch

import seqfuse
from seqfuse import ops

from harness import H200_COPY_TBS, RESULTS, Table, cuda_time_ms, plot_bars

E4M3 = torch.float8_e4m3fn


def torch_cast_transpose(x, scale):
    amax = x.abs().amax()
    q = (x * scale).to(E4M3)
    return q, q.t().contiguous(), amax


def main():
    if not (seqfuse.cuda_available() and torch.cuda.is_available()):
        print("bench_cast: needs a CUDA GPU and a CUDA build of seqfuse; skipped")
        return
    table = Table("cast", ["size", "impl", "ms", "TB_s", "pct_of_copy", "speedup_vs_torch"])
    labels, series = [], {"seqfuse": [], "copy": [], "torch": []}
    for n in (4096, 8192, 16384):
        x = torch.randn(n, n, device="cuda", dtype=torch.bfloat16) * 10
        scale = torch.tensor([2.0], device="cuda")
        amax = torch.zeros(1, device="cuda")
        scale_inv = torch.empty(1, device="cuda")
        out = torch.empty(n, n, dtype=E4M3, device="cuda")
        out_t = torch.empty(n, n, dtype=E4M3, device="cuda")
        dst = torch.empty_like(x)

        ops.cast_transpose_fp8(x, scale, amax, E4M3, out=out, out_t=out_t, scale_inv=scale_inv)
        q, qt, ta = torch_cast_transpose(x, scale)
        finite = torch.isfinite(q.float())
        assert torch.equal(out.view(torch.uint8)[finite], q.view(torch.uint8)[finite])
        assert torch.equal(out_t.view(torch.uint8), out.view(torch.uint8).t().contiguous())
        assert amax.item() == ta.item()

        bytes_moved = 4.0 * n * n
        t_sf = cuda_time_ms(lambda: ops.cast_transpose_fp8(x, scale, amax, E4M3, out=out,
                                                             out_t=out_t, scale_inv=scale_inv))
        t_copy = cuda_time_ms(lambda: dst.copy_(x))
        t_torch = cuda_time_ms(lambda: torch_cast_transpose(x, scale))
        size = f"{n}x{n}"
        for impl, t in (("seqfuse", t_sf), ("copy", t_copy), ("torch", t_torch)):
            tbs = bytes_moved / t / 1e9
            table.add(size=size, impl=impl, ms=t, TB_s=tbs, pct_of_copy=100.0 * t_copy / t,
                      speedup_vs_torch=t_torch / t)
            series[impl].append(tbs)
        labels.append(size)
        del x, out, out_t, dst, q, qt
        torch.cuda.empty_cache()
    table.save({"copy_ceiling_tbs_datasheet_run": H200_COPY_TBS,
                "goal": ">= 80% of copy bandwidth, >= 3x torch"})
    plot_bars(f"{RESULTS}/cast.png", "cast+transpose+amax bf16 -> FP8 E4M3 (read+write TB/s)",
              labels, series, "TB/s")


if __name__ == "__main__":
    main()
