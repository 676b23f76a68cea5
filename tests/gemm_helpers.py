"""Helpers of the GEMM tests: float64 references with the epilogues, and
FP8 quantization (per tensor, 1x128, 128x128) in plain torch, producing the
scale-inverse layouts sf_gemm documents (csrc/include/seqfuse_gemm.h)."""
import math

import torch

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}


def gelu_tanh(x):
    return torch.nn.functional.gelu(x, approximate="tanh")


def dgelu_tanh(x):
    x = x.detach().double().requires_grad_(True)
    with torch.enable_grad():
        (g,) = torch.autograd.grad(gelu_tanh(x).sum(), x)
    return g


def op(x, trans):
    return x.t() if trans else x


def reference(a, b, transa=False, transb=False, *, a_deq=None, b_deq=None, bias=None,
              epilogue="none", aux=None, out=None, accumulate=False, alpha=1.0):
    """float64 result of sf_gemm's definition: returns (out, extra)."""
    A = (a_deq if a_deq is not None else a).double()
    B = (b_deq if b_deq is not None else b).double()
    acc = alpha * (op(A, transa) @ op(B, transb))
    if accumulate:
        acc = acc + out.double()
    extra = None
    if bias is not None and epilogue in ("none", "bias", "gelu", "gelu_aux"):
        acc = acc + bias.double()
    if epilogue == "gelu_aux":
        extra = acc.clone()
    if epilogue in ("gelu", "gelu_aux"):
        acc = gelu_tanh(acc)
    if epilogue in ("dgelu", "dgelu_bgrad"):
        acc = acc * dgelu_tanh(aux)
    if epilogue == "dgelu_bgrad":
        extra = acc.sum(0)
    if epilogue == "bgrad":
        extra = op(A, transa).sum(1)
    return acc, extra


def quantize_tensor(x, fp8=E4M3):
    """Per-tensor: (data, scale_inv[1]) with data = x * scale in fp8."""
    amax = x.abs().max().float().clamp(min=1e-12)
    scale = FP8_MAX[fp8] / amax
    data = (x.float() * scale).clamp(-FP8_MAX[fp8], FP8_MAX[fp8]).to(fp8)
    scale_inv = (1.0 / scale).reshape(1).to(x.device)
    return data, scale_inv, data.float() * scale_inv


def quantize_1x128(x, fp8=E4M3):
    """x [rows, k]: one scale per (row, 128-run of k); scale_inv [ceil(k/128), rows]."""
    rows, k = x.shape
    kb = math.ceil(k / 128)
    xp = torch.nn.functional.pad(x.float(), (0, kb * 128 - k)).view(rows, kb, 128)
    amax = xp.abs().amax(-1).clamp(min=1e-12)  # [rows, kb]
    scale = FP8_MAX[fp8] / amax
    data = (xp * scale[..., None]).clamp(-FP8_MAX[fp8], FP8_MAX[fp8]).to(fp8)
    deq = (data.float() * (1.0 / scale)[..., None]).view(rows, kb * 128)[:, :k]
    data = data.view(rows, kb * 128)[:, :k].contiguous()
    scale_inv = (1.0 / scale).t().contiguous()  # [kb, rows]
    return data, scale_inv, deq


def quantize_128x128(x, fp8=E4M3):
    """x [rows, k]: one scale per 128x128 block; scale_inv
    [ceil(rows/128), roundup(ceil(k/128), 4)] (padding filled with 1)."""
    rows, k = x.shape
    rb, kb = math.ceil(rows / 128), math.ceil(k / 128)
    xp = torch.nn.functional.pad(x.float(), (0, kb * 128 - k, 0, rb * 128 - rows))
    blocks = xp.view(rb, 128, kb, 128)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)  # [rb, kb]
    scale = FP8_MAX[fp8] / amax
    data = (blocks * scale[:, None, :, None]).clamp(-FP8_MAX[fp8], FP8_MAX[fp8]).to(fp8)
    deq = (data.float() * (1.0 / scale)[:, None, :, None]).view(rb * 128, kb * 128)[:rows, :k]
    data = data.view(rb * 128, kb * 128)[:rows, :k].contiguous()
    kb4 = (kb + 3) // 4 * 4
    scale_inv = torch.ones(rb, kb4, dtype=torch.float32, device=x.device)
    scale_inv[:, :kb] = 1.0 / scale
    return data, scale_inv, deq


QUANTIZERS = {"tensor": quantize_tensor, "block_1x128": quantize_1x128,
              "block_128x128": quantize_128x128}
