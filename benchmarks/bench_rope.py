"""RoPE forward and backward: seqfuse's kernel against the same computation in
torch eager (Transformer Engine's unfused formula) and torch.compile of it,
same inputs, same process.  Bandwidth counts the bytes of t read and out
written (freqs are a few KB; forward+backward: twice that) against a
device-to-device copy of t measured in the same run.  Writes
results/rope.json and results/rope.png.
"""
import torch

from seqfuse.modules.rope import RotaryPositionEmbedding
from seqfuse.ops import rope_backward, rope_forward

from harness import RESULTS, Table, allow_recompiles, cuda_time_ms, plot_bars


def _rotate(x, interleaved):
    if interleaved:
        return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def torch_rope(t, freqs, interleaved):
    """bshd RoPE as TE's unfused path computes it (cos/sin in fp32, then t's dtype)."""
    rot = freqs.shape[-1]
    f = freqs[: t.shape[1]].transpose(0, 1)
    cos, sin = f.cos().to(t.dtype), f.sin().to(t.dtype)
    x, rest = t[..., :rot], t[..., rot:]
    return torch.cat((x * cos + _rotate(x, interleaved) * sin, rest), dim=-1)


def copy_tbs(t):
    out = torch.empty_like(t)
    return 2 * t.numel() * t.element_size() / cuda_time_ms(lambda: out.copy_(t)) / 1e9


def main():
    allow_recompiles()
    torch.manual_seed(0)
    table = Table("rope", ["shape", "layout", "pass", "impl", "ms", "TB_s", "pct_copy", "vs_eager", "vs_compile"])
    compiled = torch.compile(torch_rope, dynamic=False)  # specialized per shape, as a fixed-size step
    labels, series = [], {"seqfuse": [], "torch eager": [], "torch.compile": []}
    for (b, s, h, d, rot) in [(2, 4096, 32, 128, 128), (8, 4096, 32, 128, 128), (4, 2048, 16, 128, 64),
                              (8, 4096, 20, 64, 64)]:  # the last: ESM-2 650M heads
        for interleaved in (False, True):
            t = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
            ceiling = copy_tbs(t)
            dy = torch.randn_like(t)
            freqs = RotaryPositionEmbedding(rot, interleaved=interleaved)(s)
            out = torch.empty_like(t)
            bytes_moved = 2 * t.numel() * t.element_size()
            layout = "interleaved" if interleaved else "half-split"
            shape = f"bshd {b}x{s}x{h}x{d} rot {rot}"
            # forward
            tr = t.detach().requires_grad_(True)
            impls = {
                "seqfuse": (lambda: rope_forward(t, freqs, "bshd", interleaved, out=out),
                            lambda: rope_backward(dy, freqs, "bshd", interleaved, out=out)),
                "torch eager": (lambda: torch_rope(t, freqs, interleaved), None),
                "torch.compile": (lambda: compiled(t, freqs, interleaved), None),
            }
            ref = torch_rope(t.float(), freqs, interleaved)
            err = (rope_forward(t, freqs, "bshd", interleaved).float() - ref).abs().max().item()
            for pass_name in ("forward", "forward+backward"):
                times = {}
                for name, (forward, backward) in impls.items():
                    if pass_name == "forward":
                        fn = forward
                    elif backward is not None:
                        fn = lambda forward=forward, backward=backward: (forward(), backward())
                    else:
                        eager = torch_rope if name == "torch eager" else compiled
                        fn = lambda eager=eager: torch.autograd.grad(eager(tr, freqs, interleaved), tr, dy)
                    times[name] = cuda_time_ms(fn)
                mult = 1 if pass_name == "forward" else 2
                for name, ms in times.items():
                    tbs = mult * bytes_moved / ms / 1e9
                    table.add(shape=shape, layout=layout, **{"pass": pass_name}, impl=name, ms=ms, TB_s=tbs,
                              pct_copy=100 * tbs / ceiling,
                              vs_eager=times["torch eager"] / ms, vs_compile=times["torch.compile"] / ms)
                labels.append(f"{shape} {layout} {pass_name}")
                for name in series:
                    series[name].append(mult * bytes_moved / times[name] / 1e9)
            print(f"{shape} {layout}: max |seqfuse - fp32 reference| = {err:.3g}")
    table.save({"copy_ceiling": "device-to-device copy of t, measured per shape"})
    plot_bars(f"{RESULTS}/rope.png", "RoPE bf16 on H200: achieved TB/s", labels, series, "TB/s")


if __name__ == "__main__":
    main()
