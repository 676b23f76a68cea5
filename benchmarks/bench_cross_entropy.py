"""Cross-entropy forward + backward at N = 16384 tokens, V = 32k and 128k,
bf16 logits: seqfuse's fused kernels (gradient into a new buffer, and over the
logits in place) against torch eager F.cross_entropy(logits.float()) and
torch.compile of it, same inputs, same process, all through autograd.
Bandwidth counts the minimum traffic of a fused implementation: logits read
twice (forward, backward) and the gradient written once (3 N V bytes x 2),
against the H200 copy ceiling.  Then the chunked linear + cross-entropy
(hidden 16384 x 4096, V = 128256) against torch's matmul + cross-entropy:
time and peak memory.  Writes results/cross_entropy.json and .png.
"""
import torch
import torch.nn.functional as F

from seqfuse.modules.cross_entropy import cross_entropy, linear_cross_entropy

from harness import H200_COPY_TBS, RESULTS, Table, cuda_time_ms, plot_bars


def torch_ce(x, y):
    return F.cross_entropy(x.float(), y)


def main():
    torch.manual_seed(0)
    compiled = torch.compile(torch_ce)
    table = Table("cross_entropy", ["case", "impl", "ms", "TB_s", "pct_copy", "vs_eager", "vs_compile", "peak_GB"])
    labels, series = [], {"seqfuse": [], "seqfuse in place": [], "torch eager": [], "torch.compile": []}
    n = 16384
    for v in (32000, 128256):
        base = (torch.randn(n, v, device="cuda") * 2).to(torch.bfloat16)
        y = torch.randint(0, v, (n,), device="cuda")
        y[::10] = -100
        x = base.clone().requires_grad_(True)

        # in place: the backward overwrites this buffer with the gradient, and the next
        # repeat runs on those values (same cost; no extra copy is timed)
        scratch = base.clone().requires_grad_(True)

        def run(fn, inplace=False):
            def step():
                inp = scratch if inplace else x
                loss = fn(inp, y)
                (g,) = torch.autograd.grad(loss, inp)
                return g
            return step

        impls = {
            "seqfuse": run(lambda a, b: cross_entropy(a, b)),
            "seqfuse in place": run(lambda a, b: cross_entropy(a, b, inplace_backward=True), inplace=True),
            "torch eager": run(torch_ce),
            "torch.compile": run(compiled),
        }
        ref = torch_ce(x.detach(), y)
        err = (cross_entropy(x.detach(), y) - ref).abs().item()
        times = {k: cuda_time_ms(f) for k, f in impls.items()}
        peaks = {}
        for k, f in impls.items():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            f()
            torch.cuda.synchronize()
            peaks[k] = torch.cuda.max_memory_allocated() / 1e9
        bytes_min = 3 * n * v * 2
        case = f"CE forward+backward N={n} V={v} bf16"
        for k, ms in times.items():
            table.add(case=case, impl=k, ms=ms, TB_s=bytes_min / ms / 1e9, pct_copy=100 * bytes_min / ms / 1e9 / H200_COPY_TBS,
                      vs_eager=times["torch eager"] / ms, vs_compile=times["torch.compile"] / ms, peak_GB=peaks[k])
        labels.append(case)
        for k in series:
            series[k].append(bytes_min / times[k] / 1e9)
        print(f"{case}: |seqfuse - torch| loss = {err:.3g}")
        # forward alone
        forward = {"seqfuse": lambda: cross_entropy(x.detach(), y), "torch eager": lambda: torch_ce(x.detach(), y),
               "torch.compile": lambda: compiled(x.detach(), y)}
        ft = {k: cuda_time_ms(f) for k, f in forward.items()}
        for k, ms in ft.items():
            table.add(case=f"CE forward N={n} V={v} bf16", impl=k, ms=ms, TB_s=n * v * 2 / ms / 1e9,
                      pct_copy=100 * n * v * 2 / ms / 1e9 / H200_COPY_TBS,
                      vs_eager=ft["torch eager"] / ms, vs_compile=ft["torch.compile"] / ms)
        del x, base, scratch

    # chunked linear + cross-entropy
    h, v = 4096, 128256
    hidden = (torch.randn(n, h, device="cuda") * 0.5).to(torch.bfloat16).requires_grad_(True)
    weight = (torch.randn(v, h, device="cuda") * 0.02).to(torch.bfloat16).requires_grad_(True)
    y = torch.randint(0, v, (n,), device="cuda")

    def lce_seqfuse():
        return torch.autograd.grad(linear_cross_entropy(hidden, weight, y), (hidden, weight))

    def lce_torch():
        return torch.autograd.grad(F.cross_entropy((hidden @ weight.t()).float(), y), (hidden, weight))

    lce_compiled_fn = torch.compile(lambda a, w, b: F.cross_entropy((a @ w.t()).float(), b))

    def lce_compiled():
        return torch.autograd.grad(lce_compiled_fn(hidden, weight, y), (hidden, weight))

    impls = {"seqfuse chunked": lce_seqfuse, "torch eager": lce_torch, "torch.compile": lce_compiled}
    times = {k: cuda_time_ms(f, warmup=2, repeats=5) for k, f in impls.items()}
    for k, f in impls.items():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base_mem = torch.cuda.memory_allocated()
        f()
        torch.cuda.synchronize()
        table.add(case=f"linear+CE forward+backward N={n} H={h} V={v} bf16", impl=k, ms=times[k],
                  vs_eager=times["torch eager"] / times[k], vs_compile=times["torch.compile"] / times[k],
                  peak_GB=(torch.cuda.max_memory_allocated() - base_mem) / 1e9)
    table.save({"copy_ceiling_TBs": H200_COPY_TBS,
                "note": "linear_cross_entropy chunk GEMMs run on seqfuse.ops.gemm (cuBLASLt), the weight gradient "
                        "summed in the weight's dtype (linear_cross_entropy's default); "
                        "peak_GB for linear+CE is memory above what the inputs already held"})
    plot_bars(f"{RESULTS}/cross_entropy.png", "Cross-entropy forward+backward, bf16 logits, H200 (TB/s of 3 N V bytes)",
              labels, series, "TB/s")


if __name__ == "__main__":
    main()
