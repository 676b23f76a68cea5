"""Whether a training step of bench_accelerate's rows waits on the host or
on the GPU, and where the host's forward time goes.

Why: a profile's idle gaps blame host ops, but the profiler itself slows
the host; this times the step without it.  Per row (a copy of the same
Llama 1B shape model, bench_accelerate's rows): the host time to issue
the forward, the backward and the whole step (no synchronization inside),
the GPU time of the forward and of the step from an empty queue (CUDA
events), a pipelined step time (8 steps, one synchronization), and for
seqfuse's fused layers the host time of each part of a layer's forward
(qkv, rope, attention, proj, mlp_fused, the whole layer) from wrappers
that time the calls without synchronizing.

    python3 benchmarks/hf/host_forward.py --rows seqfuse_fp8_delayed,seqfuse_bf16,hf_eager
"""
import argparse
import collections
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import bench_accelerate as B  # noqa: E402


def timed_parts(model, acc, cnt, on):
    """Wrap the fused layers' parts with host timers (accumulated into acc /
    cnt while on[0]); returns a function that removes the wrappers."""
    import seqfuse.hf.fuse_layers as FL

    undo = []

    def wrap(owner, attr, name):
        fn = getattr(owner, attr)

        def timed(*a, **k):
            if not on[0]:
                return fn(*a, **k)
            t0 = time.perf_counter()
            r = fn(*a, **k)
            acc[name] += time.perf_counter() - t0
            cnt[name] += 1
            return r

        setattr(owner, attr, timed)
        undo.append((owner, attr, fn))

    for layer in B.transformer_layers(model):
        if not isinstance(layer, FL.SeqfuseDecoderLayer):
            continue
        for sub in ("qkv", "proj", "mlp_fused"):
            wrap(getattr(layer, sub), "forward", sub)
        wrap(layer, "_rope", "rope")
        wrap(layer, "forward_eager", "layer")
    if undo:
        wrap(FL, "seqfuse_attention_forward", "attention")
        wrap(FL, "split_qkv_rope", "rope")  # the usual path (one row of positions); _rope the others

    def remove():
        for owner, attr, fn in reversed(undo):
            if owner is FL:
                setattr(owner, attr, fn)
            else:
                owner.__dict__.pop(attr, None)  # back to the class's method

    return remove


def run_row(row, base, family, ids, steps):
    """One row: the timings printed (see the module note)."""
    model, _ = B.prepare(row, base, family)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    acc, cnt, on = collections.defaultdict(float), collections.Counter(), [False]
    remove = timed_parts(model, acc, cnt, on)

    def step():
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        torch.cuda.synchronize()
        ev[0].record()
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        t1 = time.perf_counter()
        ev[1].record()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        ev[2].record()
        torch.cuda.synchronize()
        return ((t1 - t0) * 1e3, ev[0].elapsed_time(ev[1]), (t2 - t1) * 1e3, (t3 - t0) * 1e3,
                ev[0].elapsed_time(ev[2]))

    for _ in range(3):
        step()
    on[0] = True
    res = [step() for _ in range(steps)]
    on[0] = False
    remove()
    best = [min(r[i] for r in res) for i in range(5)]
    print(f"== {row}: forward host issue {best[0]:.2f} ms, forward GPU {best[1]:.2f} ms, backward host "
          f"{best[2]:.2f} ms, step host issue {best[3]:.2f} ms, step GPU {best[4]:.2f} ms (best of {steps})")
    for k in acc:
        print(f"   {k:10s} {acc[k] / cnt[k] * 1e6:8.1f} us/call  {cnt[k] // steps} calls/step  "
              f"{acc[k] / steps * 1e3:.2f} ms/step (host)")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(8):
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    print(f"   pipelined step {(time.perf_counter() - t0) / 8 * 1e3:.2f} ms", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="seqfuse_fp8_delayed,seqfuse_bf16,hf_eager")
    p.add_argument("--shape", default="llama1b", choices=sorted(B.SHAPES))
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()
    dev = torch.device("cuda")
    base, family = B.build_base(args.shape, None, "cuda")
    ids = torch.randint(0, base.config.vocab_size, (1, args.seq), device=dev)
    for row in args.rows.split(","):
        run_row(row, base, family, ids, args.steps)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
