"""Which attention does Transformer Engine run here, and on which cuDNN?  A
few seconds' check before the TE rows of the peer benchmarks are timed.

Why: TE's DotProductAttention picks its backend at run time.  When TE's
import loads another libcudnn than the one torch loaded (TE searches
CUDNN_HOME, CUDNN_PATH, CUDA_HOME and /usr/local/cuda before the Python
packages; the GPU machine has cuDNN 9.14 under /usr/local/cuda, torch runs its
own 9.19), TE's cuDNN fused attention fails to build its graphs and TE falls
back to UnfusedDotProductAttention: several times slower, and out of memory
on packed ESM-2 batches.  Rows timed that way compare seqfuse with a
handicapped incumbent, so this probe says which backend TE takes before the
benchmarks spend their time.

It prints torch's cuDNN version, TE's (transformer_engine_torch
.get_cudnn_version), every libcudnn*.so file mapped into the process (two
different libcudnn.so files = the mix above, then also ``TE_PROBE
cudnn_mix=yes``), then runs DotProductAttention
forward + backward on the shapes the benchmarks use:
  esm2_bshd   ESM-2 650M heads (20 x 64), 2 x 1024 tokens, bshd, no mask;
  esm2_thd    the same heads on packed sequences (thd, cu_seqlens, padding);
  llama_bshd  Llama 1B heads (32 query / 8 key-value groups, 64), 1 x 4096,
              bshd, causal;
and prints one line per case, ``TE_PROBE <case> backend=<backend>`` (the
backend as peers.te_esm2.te_attention_backend names it), then
``TE_PROBE fused_all=yes|no``.  benchmarks/gpu_peers.sh reads those lines.
JSON with the run metadata: benchmarks/results/te_attention_probe.json.

GPU: python3 benchmarks/peers/te_probe.py.  CPU (tests, seqfuse standing in
for TE): --device cpu runs the same cases at a tiny size.
"""
import argparse
import os
import sys

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, BENCH)

import torch  # noqa: E402

import peers  # noqa: E402,F401  (seqfuse from a source checkout)
from peers.meta import skip_reason  # noqa: E402
from peers.te_esm2 import te_attention_backend  # noqa: E402
from peers.timing import Results, error_text  # noqa: E402

TE = "transformer_engine.pytorch"
#: case: (heads, kv groups, head dim, format, mask, batch, seq); thd packs `batch` sequences of varied lengths
CASES = {
    "esm2_bshd": (20, 20, 64, "bshd", "no_mask", 2, 1024),
    "esm2_thd": (20, 20, 64, "thd", "padding", 8, 1024),
    "llama_bshd": (32, 8, 64, "bshd", "causal", 1, 4096),
}
TINY = {"esm2_bshd": (2, 2, 16, "bshd", "no_mask", 2, 32), "esm2_thd": (2, 2, 16, "thd", "padding", 3, 32),
        "llama_bshd": (4, 2, 16, "bshd", "causal", 1, 64)}


def mapped_cudnn():
    """The libcudnn*.so files mapped into this process (Linux /proc/self/maps; [] elsewhere)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libcudnn" in line and "/" in line}
    except OSError:
        return []
    return sorted(paths)


def thd_lengths(batch, seq):
    """``batch`` sequence lengths between seq/4 and seq (a fixed pattern, multiples of 8)."""
    return [max(8, (seq // 4 + (i * 3 * seq) // (4 * max(1, batch - 1))) // 8 * 8) for i in range(batch)]


def run_case(te, case, spec, device, dtype):
    """DotProductAttention forward + backward for one case; returns TE's backend name."""
    heads, groups, d, fmt, mask, batch, seq = spec
    attn = te.DotProductAttention(heads, d, num_gqa_groups=groups, attention_dropout=0.0, qkv_format=fmt,
                                  attn_mask_type=mask)
    g = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype).requires_grad_()

    kw = {}
    if fmt == "thd":
        lengths = thd_lengths(batch, seq)
        t = sum(lengths)
        q, k, v = rand(t, heads, d), rand(t, groups, d), rand(t, groups, d)
        cu = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0).to(torch.int32).to(device)
        kw = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))
    else:
        q, k, v = rand(batch, seq, heads, d), rand(batch, seq, groups, d), rand(batch, seq, groups, d)
    out = attn(q, k, v, **kw)
    out.float().square().mean().backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return te_attention_backend()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma list of {', '.join(CASES)}")
    p.add_argument("--out", default="te_attention_probe", help="result name or .json path")
    args = p.parse_args(argv)
    cases = args.cases.split(",")
    bad = [c for c in cases if c not in CASES]
    if bad:
        p.error(f"--cases: unknown {bad}; choose from {', '.join(CASES)}")
    device = torch.device(args.device)
    why = skip_reason(TE, need_cuda=device.type == "cuda")
    torch_cudnn = torch.backends.cudnn.version() if device.type == "cuda" else None  # loads torch's cuDNN
    info = {"torch_cudnn": torch_cudnn, "te_skipped": why}
    if not why:
        import transformer_engine.pytorch as te

        try:
            import transformer_engine_torch as tex

            info["te_cudnn"] = tex.get_cudnn_version()
        except (ImportError, AttributeError) as e:
            info["te_cudnn"] = f"unknown ({error_text(e)})"
    info["mapped_libcudnn"] = mapped_cudnn()
    print(f"TE_PROBE torch_cudnn={torch_cudnn} te_cudnn={info.get('te_cudnn')} te_skipped={why}", flush=True)
    for path in info["mapped_libcudnn"]:
        print(f"TE_PROBE mapped {path}", flush=True)
    res = Results(args.out, __file__, extra=info)
    fused = []
    if why:
        print(f"TE_PROBE fused_all=no (Transformer Engine not usable here: {why})", flush=True)
        res.save()
        return res
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    for case in cases:
        spec = (CASES if device.type == "cuda" else TINY)[case]
        try:
            backend = run_case(te, case, spec, device, dtype)
            res.add(case=case, spec=str(spec), backend=backend)
            fused.append(backend.startswith("FusedAttention") or backend.startswith("FlashAttention"))
        except Exception as e:  # noqa: BLE001 - a case TE cannot run is itself the finding
            res.add(case=case, spec=str(spec), error=error_text(e))
            fused.append(False)
        print(f"TE_PROBE {case} backend={res.rows[-1].get('backend', res.rows[-1].get('error'))}", flush=True)
    # a second distinct libcudnn can be mapped only once attention ran: list them again
    res.doc["mapped_libcudnn_after"] = mapped_cudnn()
    if res.doc["mapped_libcudnn_after"] != info["mapped_libcudnn"]:
        for path in res.doc["mapped_libcudnn_after"]:
            print(f"TE_PROBE mapped_after {path}", flush=True)
    dirs = sorted({os.path.dirname(p) for p in res.doc["mapped_libcudnn_after"]})
    if len(dirs) > 1:  # two cuDNN installs in one process: the failure this probe exists to catch
        print(f"TE_PROBE cudnn_mix=yes: libcudnn mapped from {', '.join(dirs)}", flush=True)
    ok = bool(fused) and all(fused)
    print(f"TE_PROBE fused_all={'yes' if ok else 'no'}", flush=True)
    res.save(fused_all=ok, cudnn_dirs=dirs)
    return res


if __name__ == "__main__":
    main()
