"""Which byte offsets of an FP8 GEMM's per-tensor scale inverse does cuBLASLt take on this GPU?

Why: cuBLASLt (13.x on the H200) answered a scale pointer at a 4-byte offset
with CUBLAS_STATUS_NOT_SUPPORTED, so seqfuse's gemm entry refuses scale
inverses that are not 16-byte aligned on CUDA (csrc/gemm/gemm.c
check_scale).  This calls fp8_gemm_nt with a_scale_inv at offsets 0..256 bytes:
4 and 8 meet that check (ValueError), the rest reach cuBLASLt
and are compared with a float32 reference.  Needs a CUDA GPU; prints one
line per offset (results/logs/fp8_scale_align_probe_h200_s26.log).
"""
import torch

from seqfuse.ops.gemm import fp8_gemm_nt


def main():
    f8 = torch.float8_e4m3fn
    a = torch.randn(64, 64, device="cuda").to(f8)
    b = torch.randn(64, 64, device="cuda").to(f8)
    ref = (a.float() * 0.5) @ (b.float() * 2.0).t()
    b_scale_inv = torch.full((1,), 2.0, device="cuda")
    for offset in (0, 4, 8, 16, 32, 64, 128, 256):
        flat = torch.zeros(1 + 1024, device="cuda")
        a_scale_inv = flat[offset // 4: offset // 4 + 1]
        a_scale_inv.fill_(0.5)
        out = torch.zeros(64, 64, device="cuda")
        where = f"offset {offset:4d} B (ptr % 256 = {a_scale_inv.data_ptr() % 256:3d})"
        try:
            fp8_gemm_nt(a, a_scale_inv, None, b, b_scale_inv, None, out)
            torch.cuda.synchronize()
            print(f"{where}: ok, max err {(out - ref).abs().max().item():.3g}")
        except Exception as e:  # (the answer for this offset, whatever its type)
            print(f"{where}: {type(e).__name__}: {str(e)[:120]}")


if __name__ == "__main__":
    main()
