"""Grouped-query causal attention at Llama 3.2 1B's shape on the GPU, three
ways through torch SDPA in one process on the same inputs: FlashAttention-2
with GQA (what seqfuse's flash route runs), cuDNN with enable_gqa (what
seqfuse's cuDNN route runs since session 11), and cuDNN with K and V
expanded to every q head first.  4 x 8192 tokens, 32 q / 8 k/v heads of 64,
bf16, forward+backward; ms per call over 10 calls after 3 warm-ups, CUDA
events; gradients compared against the flash run.  This measurement chose
enable_gqa for ops.attention's cuDNN route (python/seqfuse/ops/attn/_routing.py).
    python3 benchmarks/attn/gqa_probe.py          (about 20 s on an H200)
H200, torch 2.11: logs/gqa_probe_h200_s11.log."""
import torch, torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
b, s, h, hk, d = 4, 8192, 32, 8, 64
q = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
k = torch.randn(b, hk, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
v = torch.randn(b, hk, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
flops = 4 * b * h * s * s * d / 2 * 3.5
def run(backend, expand):
    def f():
        kk, vv = (k.repeat_interleave(h // hk, 1), v.repeat_interleave(h // hk, 1)) if expand else (k, v)
        with sdpa_kernel([backend]):
            o = F.scaled_dot_product_attention(q, kk, vv, is_causal=True, enable_gqa=not expand)
        o.backward(torch.ones_like(o))
    return f
ref = None
for name, backend, expand in (("flash gqa", SDPBackend.FLASH_ATTENTION, False),
                              ("cudnn gqa", SDPBackend.CUDNN_ATTENTION, False),
                              ("cudnn expanded", SDPBackend.CUDNN_ATTENTION, True)):
    try:
        f = run(backend, expand)
        for _ in range(3): f()
        q.grad = k.grad = v.grad = None
        f(); g = [x.grad.float().clone() for x in (q, k, v)]
        if ref is None: ref = g
        err = max(((a - r).abs().max() / r.abs().max()).item() for a, r in zip(g, ref))
        st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        st.record()
        for _ in range(10): f()
        en.record(); torch.cuda.synchronize()
        ms = st.elapsed_time(en) / 10
        print(f"{name}: {ms:.2f} ms forward+backward, {flops / ms / 1e9:.0f} TFLOP/s, grad rel diff vs flash {err:.2e}")
    except Exception as e:
        print(f"{name}: FAILED {type(e).__name__}: {str(e)[:300]}")
