"""A/B of one fusion in one process: accelerate()'d Llama 1B steps
(bench_accelerate's rows) with the fusion ("new") and with the path before
it patched back ("old"), interleaved rounds of pipelined steps, medians.  A
row "prefill:<row>" times generation's prefill (no grad, key cache) instead
of a training step; "stack:esm650" the FP8 delayed step of 33
seqfuse.pytorch.TransformerLayer at ESM-2 650M's shape, 16 x 1,024 tokens
(bench_fp8_weight_transpose.py's row).  Switches (``--switch``):

  split_qkv_rope  seqfuse.modules.rope.split_qkv_rope against torch.split and
                  two apply_rotary_pos_emb calls
  residual        the residual adds in the GEMM epilogues against the adds
                  after the GEMMs (SeqfuseDecoderLayer's and TransformerLayer's
                  _residual_fusable)
  act_grad_fp8    LayerNormMLP's activation gradient written in FP8 by its
                  kernel against the bf16 gradient and its cast
                  (GradQuantizer.fused_cast)
  attn_residual_grad  the attention block's residual gradient added in the
                  QKV norm's backward pass (LayerNormLinear's
                  return_input_alias) against autograd's add of it
  transient_buffers  buffers that live inside one call kept and reused
                  (seqfuse.ops.buffers) against a new allocation each
                  (TRANSIENT_POOL_BYTES = 0)
  save_original_input  the fused layers' attention projection keeping the
                  attention output and making its FP8 transposed copy again
                  in the backward (Linear's save_original_input) against
                  keeping the FP8 copy
  loss_chunk      linear_cross_entropy's default chunk (a quarter of the
                  logits within 256-512 MiB) against 256 MiB chunks
  loss_grad_scale  the fused loss's gradients scaled by the loss's gradient
                  with seqfuse's multi-tensor scale (no pass when it is 1)
                  against torch's multiply of each (a pass over the LM
                  head's weight gradient)
  weight_history  delayed scaling's weight casts with the scale of the
                  weight's amax history where it describes the weight (one
                  pass over each weight: the default) against casts from its
                  own amax (an amax pass, then the cast: a module's
                  fp8_weight_history = False)
  tied_embedding  a tied input embedding's gradient added into the fused
                  loss's head gradient by its backward (tied_embedding)
                  against transformers' lookup, whose dense gradient
                  autograd adds to the head's (a [V, H] fill and add)
  one_pass_swiglu LayerNormMLP's FP8 SwiGLU as the grouped SwiGLU cast and,
                  in the backward, one grouped SwiGLU pass that writes FC2's
                  wgrad operand and FC1's FP8 output gradient with its
                  transposed copy, against the activation kernels (the
                  activation made again, its FP8 gradient, two byte
                  transposes)
  qkv_one_launch  split_qkv_rope's q and k turned and v copied in one launch
                  forward, the three gradients written in one backward
                  (ops.rope.rope_parts), against q and k turned in one launch
                  and v copied in another (8-byte words), the gradients in
                  three
  gemm_tune       the fused loss's weight-gradient sum on the algorithm
                  seqfuse.ops.gemm.tune kept (cuBLASLt's candidates timed
                  once per plan) against the heuristic's first choice
                  (seqfuse.ops.gemm.set_tuning); each switch drops the plan cache, so
                  each round's untimed first step queries (and tunes) again

``--profile``: also each mode's GPU kernel time per step (torch.profiler
over 3 steps; immune to launch gaps and host noise) and the kernels whose
time differs most.  On the GPU machine:

    python3 benchmarks/hf/fusion_ab.py --switch residual seqfuse_fp8_delayed,seqfuse_bf16

Writes results/fusion_ab_<switch>.json (or ``--out``: the name) with the
run's commit, command and versions.  Earlier results (logs only, made
before the JSON): benchmarks/results/logs/split_qkv_rope_ab_s30_687b3e5.log
(this script's first form, split_qkv_rope only), fusion_ab_s31*.log.
"""
import argparse
import importlib
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # bench_accelerate; benchmarks/ (harness, bench_fp8_weight_transpose)

import torch  # noqa: E402

import bench_accelerate as B  # noqa: E402
from harness import Table  # noqa: E402
import seqfuse.hf.fuse_layers as FL  # noqa: E402
import seqfuse.hf.fused_loss as FLOSS  # noqa: E402
from seqfuse.modules.rope import apply_rotary_pos_emb  # noqa: E402
from seqfuse.modules import layernorm_mlp as LNMLP  # noqa: E402
from seqfuse.modules.layernorm_linear import LayerNormLinear  # noqa: E402
from seqfuse.modules.linear import Linear  # noqa: E402
from seqfuse.modules.transformer_layer import TransformerLayer  # noqa: E402
from seqfuse.ops import buffers  # noqa: E402
from seqfuse.quantization.gemm_quantizers import GradQuantizer, WeightQuantizer  # noqa: E402


def _old_split_qkv_rope(mixed, freqs, heads, kv_heads, d):
    """The path before split_qkv_rope: split, then q and k turned apart."""
    b, s = mixed.shape[:2]
    q, k, v = torch.split(mixed, [heads * d, kv_heads * d, kv_heads * d], dim=-1)
    return (apply_rotary_pos_emb(q.view(b, s, heads, d), freqs, "bshd"),
            apply_rotary_pos_emb(k.view(b, s, kv_heads, d), freqs, "bshd"), v.view(b, s, kv_heads, d))


def _attribute_switch(owner, name, old_value):
    """(set new, set old) for an attribute patched on ``owner`` (one it
    inherits: the patch is removed again for "new")."""
    if name in owner.__dict__:
        new_value = owner.__dict__[name]
        return (lambda: setattr(owner, name, new_value)), (lambda: setattr(owner, name, old_value))

    def set_new():
        if name in owner.__dict__:
            delattr(owner, name)

    return set_new, (lambda: setattr(owner, name, old_value))


def _pool_switch():
    """(keep transient buffers, keep none): the old mode lets the kept ones go."""
    limit = buffers.TRANSIENT_POOL_BYTES

    def set_old():
        buffers.TRANSIENT_POOL_BYTES = 0
        buffers.clear()

    return (lambda: setattr(buffers, "TRANSIENT_POOL_BYTES", limit)), set_old


CE = importlib.import_module("seqfuse.modules.cross_entropy")  # (the package exports a function of that name)
_chunk_rule = CE.default_chunk_size


ROPE = importlib.import_module("seqfuse.modules.rope")
GEMM = importlib.import_module("seqfuse.ops.gemm")  # (the package exports the op under the module's name)


def _together(*switches):
    """One switch setting several."""
    return (lambda: [s[0]() for s in switches]), (lambda: [s[1]() for s in switches])


_aliasing_forward = LayerNormLinear.forward


def _forward_without_alias(self, inp, is_first_microbatch=None, fp8_output=False, fp8_grad=False,
                           return_input_alias=False):
    """LayerNormLinear.forward with the input itself for the alias: the path
    before return_input_alias (autograd adds the residual's gradient)."""
    out = _aliasing_forward(self, inp, is_first_microbatch, fp8_output, fp8_grad)
    if not return_input_alias:
        return out
    return out + (inp,) if isinstance(out, tuple) else (out, inp)


def _scale_with_torch(grads, g):
    """The fused loss's gradient scaling before multi_tensor_scale: torch's
    multiply of each gradient by the loss's gradient in its dtype."""
    for t in grads:
        t.mul_(g.to(t.dtype))


_history_cast = WeightQuantizer._cast_into


def _cast_from_own_amax(self, w, scale_inv, data, data_t, in_capture=None, from_history=False):
    """WeightQuantizer._cast_into as a module with fp8_weight_history False
    casts: from the weight's own amax."""
    return _history_cast(self, w, scale_inv, data, data_t, in_capture, False)


SWITCHES = {
    "split_qkv_rope": lambda: _attribute_switch(FL, "split_qkv_rope", _old_split_qkv_rope),
    "residual": lambda: _together(
        _attribute_switch(FL.SeqfuseDecoderLayer, "_residual_fusable", lambda self, residual, out_dtype, which: False),
        _attribute_switch(TransformerLayer, "_residual_fusable", lambda self, residual, out_dtype: False)),
    "act_grad_fp8": lambda: _attribute_switch(GradQuantizer, "fused_cast", property(lambda self: False)),
    "attn_residual_grad": lambda: _attribute_switch(LayerNormLinear, "forward", _forward_without_alias),
    "transient_buffers": _pool_switch,
    # (a class property outranks the instance attribute the fused layers set; its setter lets a Linear be built
    # while the old path is on)
    "save_original_input": lambda: _attribute_switch(Linear, "save_original_input", property(
        lambda self: False, lambda self, value: self.__dict__.__setitem__("save_original_input", value))),
    "loss_chunk": lambda: _attribute_switch(
        CE, "default_chunk_size", lambda n, v, es, budget_bytes=256 << 20: _chunk_rule(n, v, es, budget_bytes)),
    "weight_history": lambda: _attribute_switch(WeightQuantizer, "_cast_into", _cast_from_own_amax),
    "loss_grad_scale": lambda: _attribute_switch(CE, "scale_by_loss_grad", _scale_with_torch),
    "tied_embedding": lambda: _attribute_switch(FLOSS, "_tied_link", lambda model, call: None),
    "one_pass_swiglu": lambda: _attribute_switch(LNMLP, "_one_pass_swiglu", lambda q, h, activation: False),
    "gemm_tune": lambda: ((lambda: GEMM.set_tuning(True)), (lambda: GEMM.set_tuning(False))),
    "qkv_one_launch": lambda: _attribute_switch(ROPE, "ONE_LAUNCH", False),
}


def stepper(row, base, family, ids):
    if row.startswith("stack:"):
        import bench_fp8_weight_transpose as W

        step = W.ROWS[row.split(":")[1]](torch.device("cuda"))

        def stack_steps(n):
            for _ in range(n):
                step()

        return stack_steps
    prefill = row.startswith("prefill:")
    model, _ = B.prepare(row.split(":")[-1], base, family)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    model.train(not prefill)

    def steps(n):
        for _ in range(n):
            if prefill:
                with torch.no_grad():
                    model(input_ids=ids, use_cache=True, logits_to_keep=1)
            else:
                model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

    return steps


def ab(steps, switch, rounds=6, per_round=6):
    """{mode: [ms per step of each round]}: ``rounds`` rounds that time
    ``per_round`` pipelined steps of each mode, which mode goes first
    alternating from round to round (neither is always timed first)."""
    set_new, set_old = switch
    times = {"new": [], "old": []}
    modes = (("new", set_new), ("old", set_old))
    try:
        for _, use in modes:
            use()
            steps(3)
        for r in range(rounds):
            for name, use in (modes if r % 2 == 0 else modes[::-1]):
                use()
                steps(1)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                steps(per_round)
                torch.cuda.synchronize()
                times[name].append((time.perf_counter() - t0) / per_round * 1e3)
    finally:
        set_new()  # (the fusion on again, whatever happened)
    return times


def kernel_times(steps, switch, n=3):
    """{mode: {kernel name: us per step}} from torch.profiler over ``n`` steps."""
    from torch.profiler import ProfilerActivity, profile

    out = {}
    try:
        for name, use in zip(("new", "old"), switch):
            use()
            steps(2)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                steps(n)
                torch.cuda.synchronize()
            per = {}
            for ev in prof.key_averages():
                t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
                if t and ev.key and not ev.key.startswith("aten::") and not ev.key.startswith("cuda"):
                    per[ev.key] = per.get(ev.key, 0.0) + t / n
            out[name] = per
    finally:
        switch[0]()
    return out


def report_kernels(label, per, top=0):
    """Print each mode's kernel time per step (and the kernels that differ
    most); returns (new, old) in ms."""
    new, old = per["new"], per["old"]
    if top:
        print(f"{label}: the {top} kernels with the most GPU time per step (new)")
        for k in sorted(new, key=lambda k: -new[k])[:top]:
            print(f"   {new[k]:9.1f} us  {k[:130]}")
    print(f"{label}: GPU kernel time per step new {sum(new.values()) / 1e3:.2f} ms, "
          f"old {sum(old.values()) / 1e3:.2f} ms", flush=True)
    diff = sorted(set(new) | set(old), key=lambda k: -abs(new.get(k, 0.0) - old.get(k, 0.0)))
    for k in diff[:8]:
        print(f"   {new.get(k, 0.0) - old.get(k, 0.0):+9.1f} us  new {new.get(k, 0.0):8.1f}  old {old.get(k, 0.0):8.1f}"
              f"  {k[:110]}")
    return sum(new.values()) / 1e3, sum(old.values()) / 1e3


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("rows", help="comma list of bench_accelerate rows, or prefill:<row>")
    p.add_argument("--switch", default="split_qkv_rope", choices=sorted(SWITCHES))
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--top", type=int, default=0, help="with --profile: list the new mode's N largest kernels")
    p.add_argument("--out", default=None, help="results JSON name (default fusion_ab_<switch>)")
    args = p.parse_args(argv)
    if any(r.endswith("_graphed") for r in args.rows.split(",")):
        p.error("rows: a _graphed row replays one captured graph whichever way the switch is set; "
                "A/B its eager row")
    switch = SWITCHES[args.switch]()
    table = Table(args.out or f"fusion_ab_{args.switch}", ["row", "new_ms", "old_ms", "ratio", "new_kernel_ms",
                                                           "old_kernel_ms"])
    base, family = B.build_base("llama1b", None, "cuda")
    ids = torch.randint(0, base.config.vocab_size, (1, args.seq), device="cuda")
    for row in args.rows.split(","):
        steps = stepper(row, base, family, ids)
        times = ab(steps, switch, rounds=args.rounds)
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"{args.switch} {row}: step ms new {['%.2f' % x for x in times['new']]} "
              f"old {['%.2f' % x for x in times['old']]}; median new {med['new']:.2f} old {med['old']:.2f} "
              f"-> {med['old'] / med['new']:.4f}x", flush=True)
        kernels = {}
        if args.profile:
            kernels = dict(zip(("new_kernel_ms", "old_kernel_ms"),
                               report_kernels(f"{args.switch} {row}", kernel_times(steps, switch), args.top)))
        table.add(row=row, new_ms=med["new"], old_ms=med["old"], ratio=med["old"] / med["new"],
                  new_rounds_ms=times["new"], old_rounds_ms=times["old"], **kernels)
        torch.cuda.empty_cache()
    table.save({"switch": args.switch, "seq": args.seq, "rounds": args.rounds,
                "note": "new: the fusion on; old: switched off in the same process; medians of interleaved rounds "
                        "of 6 pipelined steps (the first mode alternating) after 3 warm-up steps per mode; "
                        "ratio = old / new; kernel ms: "
                        "GPU kernel time per step from torch.profiler over 3 steps"})


if __name__ == "__main__":
    main()
