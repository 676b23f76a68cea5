"""Tolerances and checks shared by the tests (device METHOD.md): relative
error ||out - ref|| / ||ref|| against a float64 reference, by dtype."""
import torch

#: Relative-error bounds by the dtype of the computation's inputs.
REL_TOL = {
    torch.float64: 1e-12,
    torch.float32: 1e-5,
    torch.float16: 2e-3,
    torch.bfloat16: 1e-2,
}

POISON = float("nan")


def rel_error(out, ref):
    out = out.detach().to(torch.float64).cpu()
    ref = ref.detach().to(torch.float64).cpu()
    assert not torch.isnan(out).any(), "output holds NaN (an unwritten element?)"
    denom = ref.norm()
    if denom == 0:
        return out.norm().item()
    return ((out - ref).norm() / denom).item()


def assert_close_rel(out, ref, dtype, factor=1.0):
    err = rel_error(out, ref)
    tol = REL_TOL[dtype] * factor
    assert err <= tol, f"relative error {err:.3e} > {tol:.1e} for {dtype}"


def poisoned_like(t):
    """An output buffer filled with NaN (or 0xFF bytes for integer and fp8
    types) so an element the kernel forgot to write cannot pass."""
    out = torch.empty_like(t)
    if out.dtype.is_floating_point and out.element_size() >= 2:
        out.fill_(POISON)
    else:
        out.view(torch.uint8).fill_(0xFF)
    return out
