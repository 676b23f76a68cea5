"""FusedAdamW and clip_grad_norm_ on a 1B-parameter set (200 tensors of 5M
elements), same process, same gradients:

- bf16 parameters with fp32 master weights (seqfuse.optim.FusedAdamW)
  against torch.optim.AdamW(fused=True) on fp32 parameters: the two ways to
  keep an fp32 copy of the weights;
- bf16 parameters with bf16 moments and no master copy, the state
  torch.optim.AdamW keeps for bf16 parameters (FusedAdamW with
  master_weights=False and bf16 moments against torch fused on the same
  parameters: the same update, the Mixtral and Llama benches' like-for-like
  optimizer);
- fp32 against fp32 (FusedAdamW vs torch fused and foreach);
- the gradient 2-norm + clip (seqfuse.optim.clip_grad_norm_ vs
  torch.nn.utils.clip_grad_norm_, foreach).

Bandwidth counts the bytes an update must move: bf16 + master: grad 2 +
master 4+4 + moments 16 + param write 2 = 28 B per parameter; bf16 state:
param 2+2 + grad 2 + moments 4+4 = 14 B; fp32: param
4+4 + grad 4 + moments 16 = 28 B.  Time is device time of optimizer.step()
(host launch work included, L2 flushed); then the host time of one step()
over 200 small parameters against torch fused.  Writes results/adamw.json,
.png.  ``--host-only cpu`` (or cuda) times only the host cases, on that
device: results/adamw_host.json.
"""
import argparse

import torch

from seqfuse.optim import FusedAdamW, clip_grad_norm_

from harness import H200_COPY_TBS, RESULTS, Table, cuda_time_ms, host_time_us, plot_bars

N_TENSORS, NUMEL = 200, 5_000_000


def make(dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    params = []
    for _ in range(N_TENSORS):
        p = torch.nn.Parameter(torch.randn(NUMEL, device="cuda", generator=g).to(dtype))
        p.grad = (torch.randn(NUMEL, device="cuda", generator=g) * 1e-3).to(dtype)
        params.append(p)
    return params


def host_cases(table, device, hyper):
    """Host time of one step() over 200 small parameters, FusedAdamW against
    torch's fused AdamW on the same parameters: fp32, and bf16 with bf16
    moments and no master (torch's bf16 state).  On the GPU the tensors hold
    1,024 elements (the launch work, not the GPU's); on the CPU, where the
    update itself runs on the host, 16."""
    numel = 1024 if device.type == "cuda" else 16
    for dtype, kw in ((torch.float32, {}), (torch.bfloat16, dict(master_weights=False, exp_avg_dtype=torch.bfloat16,
                                                                 exp_avg_sq_dtype=torch.bfloat16))):
        small = [torch.nn.Parameter(torch.randn(numel, device=device).to(dtype)) for _ in range(N_TENSORS)]
        for p in small:
            p.grad = torch.randn_like(p)
        ours, theirs = FusedAdamW(small, **kw, **hyper), torch.optim.AdamW(small, fused=True, **hyper)
        h_ours = host_time_us(ours.step, calls=200, rounds=5)
        h_theirs = host_time_us(theirs.step, calls=200, rounds=5)
        name = str(dtype).removeprefix("torch.")
        case = f"host time per step(), {N_TENSORS} {name} tensors x {numel} ({device.type})"
        for impl, us in (("seqfuse FusedAdamW" + (" (bf16 moments, no master)" if kw else ""), h_ours),
                         ("torch AdamW fused=True", h_theirs)):
            table.add(case=case, impl=impl, host_us=us, vs_torch_fused=h_theirs / us)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--host-only", choices=("cpu", "cuda"), default=None,
                    help="only the host-time cases, on this device (results/adamw_host.json): on the CPU the "
                         "optimizers' host work with no GPU")
    args = ap.parse_args()
    hyper = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    if args.host_only:
        table = Table("adamw_host", ["case", "impl", "host_us", "vs_torch_fused"])
        host_cases(table, torch.device(args.host_only), hyper)
        table.save({"note": "median of 5 rounds of 200 step() calls each (harness.host_time_us)"})
        return
    n = N_TENSORS * NUMEL
    table = Table("adamw", ["case", "impl", "ms", "TB_s", "pct_copy", "vs_torch_fused", "host_us"])
    labels, series = [], {"seqfuse": [], "torch fused": []}

    def add_case(case, label, bytes_per_param, torch_ms, rows):
        """The table rows of one case, ``rows`` (impl, ms) with seqfuse's first:
        bandwidth at ``bytes_per_param`` bytes moved per parameter, speed
        against torch's ``torch_ms``; and the plot's seqfuse / torch pair."""
        for impl, ms in rows:
            table.add(case=case, impl=impl, ms=ms, TB_s=bytes_per_param * n / ms / 1e9,
                      pct_copy=100 * bytes_per_param * n / ms / 1e9 / H200_COPY_TBS, vs_torch_fused=torch_ms / ms)
        labels.append(label)
        series["seqfuse"].append(rows[0][1])
        series["torch fused"].append(torch_ms)

    # --- bf16 params + fp32 master vs torch fused on fp32 params
    bf16 = make(torch.bfloat16)
    ours = FusedAdamW(bf16, master_weights=True, **hyper)
    ours.step()
    t_ours = cuda_time_ms(ours.step)
    del ours, bf16
    torch.cuda.empty_cache()
    fp32 = make(torch.float32)
    theirs = torch.optim.AdamW(fp32, fused=True, **hyper)
    theirs.step()
    t_theirs = cuda_time_ms(theirs.step)
    add_case("1B params: bf16 + fp32 master vs torch fused fp32", "bf16+master vs fp32 fused", 28, t_theirs,
             [("seqfuse FusedAdamW (bf16 + master)", t_ours), ("torch AdamW fused=True (fp32)", t_theirs)])

    # --- bf16 parameters, bf16 moments, no master: one update, two kernels
    bf16 = make(torch.bfloat16)
    ours = FusedAdamW(bf16, master_weights=False, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16,
                      **hyper)
    ours.step()
    t_ours = cuda_time_ms(ours.step)
    del ours
    theirs_bf16 = torch.optim.AdamW(bf16, fused=True, **hyper)
    theirs_bf16.step()
    t_theirs_bf16 = cuda_time_ms(theirs_bf16.step)
    add_case("1B bf16 params: bf16 moments, no master (torch's bf16 state)", "bf16 state vs bf16 fused", 14,
             t_theirs_bf16, [("seqfuse FusedAdamW (bf16, bf16 moments)", t_ours),
                             ("torch AdamW fused=True (bf16)", t_theirs_bf16)])
    del theirs_bf16, bf16
    torch.cuda.empty_cache()

    # --- fp32 vs fp32
    ours = FusedAdamW(fp32, **hyper)
    ours.step()
    t_ours = cuda_time_ms(ours.step)
    foreach = torch.optim.AdamW(fp32, foreach=True, **hyper)
    foreach.step()
    t_foreach = cuda_time_ms(foreach.step)
    add_case("1B params: fp32 vs fp32", "fp32 vs fp32", 28, t_theirs,
             [("seqfuse FusedAdamW", t_ours), ("torch AdamW fused=True", t_theirs),
              ("torch AdamW foreach=True", t_foreach)])
    del foreach, ours, theirs

    # --- gradient norm + clip over 1B fp32 gradients (read + write: 8 B per element)
    t_clip = cuda_time_ms(lambda: clip_grad_norm_(fp32, 1.0))
    t_tclip = cuda_time_ms(lambda: torch.nn.utils.clip_grad_norm_(fp32, 1.0, foreach=True))
    add_case("1B fp32 grads: 2-norm + clip", "clip 1B fp32 grads", 12, t_tclip,
             [("seqfuse clip_grad_norm_", t_clip), ("torch clip_grad_norm_ foreach", t_tclip)])
    del fp32
    torch.cuda.empty_cache()

    host_cases(table, torch.device("cuda"), hyper)
    torch.cuda.synchronize()
    table.save({"copy_ceiling_TBs": H200_COPY_TBS, "n_params": n,
                "note": "clip bytes: read for the norm (4 B) + read/write for the scale (8 B) per element; "
                        "vs_torch_fused of the clip row is against torch's foreach clip"})
    plot_bars(f"{RESULTS}/adamw.png", "AdamW step / clip on 1B params, H200 (ms, lower is better)", labels,
              series, "ms")


if __name__ == "__main__":
    main()
