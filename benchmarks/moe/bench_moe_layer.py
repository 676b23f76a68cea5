"""The MoE layer, forward + backward: seqfuse's GroupedMLP (C router,
permutation, grouped GEMMs, fused probability-scaled SwiGLU) against
transformers' MixtralSparseMoeBlock on the same weights and tokens, same
process: its eager loop over experts and, where this transformers has it,
its grouped_mm experts implementation (torch._grouped_mm).

Mixtral-small shape: hidden 1024, FFN 3584, 8 experts, top-2, 4 x 4096 =
16,384 tokens, bf16.  seqfuse also runs FP8 (Float8CurrentScaling and
DelayedScaling) for its two grouped GEMMs.  Each row is the median of 20
timed steps after 5 warm-up steps (CUDA events; the weights do not change
between steps, so FP8 weight casts are reused after the first, as in
gradient accumulation; the routing, permutation and m_splits host read
happen every step).  A first line checks that seqfuse's bf16 output matches
transformers' eager one (relative error).  Writes
benchmarks/results/moe_layer.json.  About 30-60 s on an H200 (plus the
build).

    python3 benchmarks/moe/bench_moe_layer.py
"""
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # benchmarks/: harness
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "python"))

from harness import Table, cuda_time_ms  # noqa: E402

from seqfuse.common.recipe import DelayedScaling, Float8CurrentScaling  # noqa: E402
from seqfuse.modules import GroupedMLP  # noqa: E402
from seqfuse.quantization import fp8_autocast  # noqa: E402

HIDDEN, FFN, EXPERTS, TOPK, BATCH, SEQ = 1024, 3584, 8, 2, 4, 4096


def hf_block(impl):
    """transformers' MixtralSparseMoeBlock with the experts implementation
    `impl`, or (None, reason)."""
    try:
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    except ImportError as e:
        return None, f"transformers Mixtral not importable: {e}"
    cfg = MixtralConfig(hidden_size=HIDDEN, intermediate_size=FFN, num_local_experts=EXPERTS,
                        num_experts_per_tok=TOPK, router_jitter_noise=0.0)
    cfg._experts_implementation = impl
    try:
        block = MixtralSparseMoeBlock(cfg).cuda().bfloat16()
    except Exception as e:  # noqa: BLE001 - report why the peer is missing
        return None, f"{type(e).__name__}: {str(e)[:160]}"
    return block, f"transformers MixtralSparseMoeBlock ({impl})"


def copy_weights(block, mlp):
    """transformers' Mixtral block weights into GroupedMLP (same layout: gate rows first)."""
    with torch.no_grad():
        mlp.router_weight.copy_(block.gate.weight)
        ex = block.experts
        for e in range(EXPERTS):
            if hasattr(ex, "gate_up_proj"):  # transformers 5: 3-D expert tensors
                getattr(mlp.fc1, f"weight{e}").copy_(ex.gate_up_proj[e])
                getattr(mlp.fc2, f"weight{e}").copy_(ex.down_proj[e])
            else:  # transformers 4: one module per expert (w1 gate, w3 up, w2 down)
                getattr(mlp.fc1, f"weight{e}").copy_(torch.cat([ex[e].w1.weight, ex[e].w3.weight]))
                getattr(mlp.fc2, f"weight{e}").copy_(ex[e].w2.weight)


def step_fn(module, x, g, ctx=None):
    def step():
        xi = x.detach().requires_grad_()
        if ctx is None:
            y = module(xi)
        else:
            with ctx():
                y = module(xi)
        if isinstance(y, tuple):
            y = y[0]
        y.backward(g)
    return step


def main():
    torch.manual_seed(0)
    tokens = BATCH * SEQ
    table = Table("moe_layer", ["layer", "precision", "ms", "tokens_per_s", "vs_hf_eager", "note"])
    x = torch.randn(BATCH, SEQ, HIDDEN, device="cuda").bfloat16()
    g = torch.randn(BATCH, SEQ, HIDDEN, device="cuda").bfloat16()
    eager, eager_name = hf_block("eager")
    if eager is None:
        print(f"no transformers peer: {eager_name}")
    with torch.no_grad():
        for p in (eager.parameters() if eager is not None else []):
            p.normal_(0, 0.02)
    mlp = GroupedMLP(HIDDEN, FFN, EXPERTS, TOPK, device="cuda", params_dtype=torch.bfloat16)
    check = {}
    if eager is not None:
        copy_weights(eager, mlp)
        with torch.no_grad():
            ref = eager(x)
            ref = ref[0] if isinstance(ref, tuple) else ref
            out = mlp(x)
            # bf16 router logits tie now and then, and the two break ties differently:
            # compare the tokens both route to the same experts
            x2 = x.view(-1, HIDDEN)
            gate = eager.gate(x2)
            idx = gate[2] if isinstance(gate, tuple) else gate.float().topk(TOPK, -1).indices
            hf_map = torch.zeros(x2.shape[0], EXPERTS, dtype=torch.bool, device=x.device).scatter_(1, idx, True)
            same = (hf_map == mlp.route(x2)[1]).all(-1)
            diff = (out.float() - ref.float()).view(-1, HIDDEN)[same]
        check["routing_agreement"] = same.float().mean().item()
        check["rel_error_vs_hf_eager_same_routing"] = (diff.norm() / ref.float().view(-1, HIDDEN)[same].norm()).item()
        print(f"seqfuse vs transformers eager: {check['routing_agreement']:.2%} of tokens routed alike, "
              f"relative error on those {check['rel_error_vs_hf_eager_same_routing']:.3e}")
    base = float("nan")
    if eager is not None:
        base = cuda_time_ms(step_fn(eager, x, g), warmup=3, repeats=10)
        table.add(layer=eager_name, precision="bf16", ms=base, tokens_per_s=tokens / base * 1e3,
                  vs_hf_eager=1.0, note="loop over experts")
    grouped, grouped_name = hf_block("grouped_mm")
    if grouped is not None and eager is not None:
        grouped.load_state_dict(eager.state_dict())
        try:
            ms = cuda_time_ms(step_fn(grouped, x, g))
            table.add(layer=grouped_name, precision="bf16", ms=ms, tokens_per_s=tokens / ms * 1e3,
                      vs_hf_eager=base / ms, note="torch._grouped_mm")
        except Exception as e:  # noqa: BLE001
            print(f"transformers grouped_mm failed: {type(e).__name__}: {str(e)[:200]}")
    elif grouped is None:
        print(f"no transformers grouped_mm peer: {grouped_name}")
    rows = [("bf16", None)]
    rows += [("fp8 current", lambda: fp8_autocast(enabled=True, fp8_recipe=Float8CurrentScaling())),
             ("fp8 delayed", lambda: fp8_autocast(enabled=True, fp8_recipe=DelayedScaling()))]
    for precision, ctx in rows:
        ms = cuda_time_ms(step_fn(mlp, x, g, ctx))
        table.add(layer="seqfuse GroupedMLP", precision=precision, ms=ms, tokens_per_s=tokens / ms * 1e3,
                  vs_hf_eager=base / ms, note="one cuBLASLt call per expert")
    path = table.save({"check": check, "shape": {"hidden": HIDDEN, "ffn": FFN, "experts": EXPERTS,
                                                 "topk": TOPK, "tokens": tokens},
                       "command": "python3 benchmarks/moe/bench_moe_layer.py"})
    with open(path) as f:
        print(json.dumps(json.load(f), indent=1))


if __name__ == "__main__":
    main()
