"""What a transformers Llama keeps from its training forward for the
backward, before and after seqfuse.hf.accelerate(): every distinct storage
the autograd graph saves (parameters left out), with its shape, dtype and
size in [tokens, hidden] bf16 units, and the peak memory of one step.

Why: a memory goal against Liger-Kernel (issue 21) is decided by these
tensors; a count by saved-tensor hooks names each of them, which a peak
figure alone does not.  Storages saved by more than one op are counted
once and listed with every shape they were saved under (a tensor a module
saves as a view of another's shows up there).

    python3 benchmarks/hf/probe_saved.py --device cuda --layers 2 --seq 4096
    python3 benchmarks/hf/probe_saved.py --rows plain,bf16_keep,bf16,fp8_delayed

Rows: plain (transformers as built), bf16 (accelerate(model)), bf16_keep
(accelerate(model, recompute_activation=False): the MLPs keep their gated
activation), fp8_delayed (accelerate(model, recipe=DelayedScaling())).
"""
import argparse
import collections
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def build(args, device):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.ffn, num_hidden_layers=args.layers,
                      num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                      vocab_size=args.vocab, max_position_embeddings=max(args.seq, 128),
                      attn_implementation="sdpa", torch_dtype=torch.bfloat16)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(device=device, dtype=torch.bfloat16)


def probe(model, ids):
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = collections.OrderedDict()

    def pack(t):
        st = t.untyped_storage()
        key = st.data_ptr()
        if key not in params and key != 0:
            entry = seen.setdefault(key, {"bytes": st.nbytes(), "views": []})
            view = (tuple(t.shape), str(t.dtype).replace("torch.", ""))
            if view not in entry["views"]:
                entry["views"].append(view)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return seen


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=8192)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--rows", default="plain,bf16_keep,bf16,fp8_delayed")
    p.add_argument("--top", type=int, default=40, help="storages listed per row (largest first)")
    p.add_argument("--out", default=None, help="JSON file for the listing")
    args = p.parse_args()
    from seqfuse.common.recipe import DelayedScaling
    from seqfuse.hf import accelerate

    dev = torch.device(args.device)
    ids = torch.randint(0, args.vocab, (1, args.seq), device=dev)
    unit = args.seq * args.hidden * 2
    report = {"args": vars(args), "rows": {}}
    for row in args.rows.split(","):
        model = build(args, dev)
        if row != "plain":  # (the FP8 row's forward runs under the recipe's autocast)
            accelerate(model, recipe=DelayedScaling() if row.startswith("fp8") else None,
                       **({"recompute_activation": False} if row.endswith("_keep") else {}))
        model.train()
        probe(model, ids)  # a first step (FP8's first casts and histories)
        model.zero_grad(set_to_none=True)
        if dev.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        seen = probe(model, ids)
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if dev.type == "cuda" else None
        total = sum(e["bytes"] for e in seen.values())
        print(f"== {row}: {len(seen)} saved storages, {total / 2**30:.3f} GiB = {total / unit:.2f} "
              f"[tokens, hidden] bf16 units ({total / unit / args.layers:.2f} a layer); step peak over "
              f"the weights and grads before it: {peak if peak is None else round(peak, 3)} GiB")
        ranked = sorted(seen.values(), key=lambda e: -e["bytes"])
        for e in ranked[:args.top]:
            print(f"  {e['bytes'] / unit:7.3f} units  {e['bytes'] / 2**20:9.2f} MiB  "
                  + "; ".join(f"{list(s)} {d}" for s, d in e["views"]))
        report["rows"][row] = {"saved_bytes": total, "units_per_layer": total / unit / args.layers,
                               "peak_gib": peak,
                               "storages": [{"bytes": e["bytes"], "views": e["views"]} for e in ranked]}
        del model
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
