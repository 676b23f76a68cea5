"""One short line per row of the peer benchmarks' result JSONs, for the end
of a GPU run's output (benchmarks/gpu_peers.sh): the reply of a GPU call
keeps only the last few thousand characters, and the benchmarks' own tables
are hundreds of characters wide.  The JSONs and full logs stay the record;
this is the reading aid.

  python3 benchmarks/peers/summary.py esm2_peers te_modules torchao llama3_liger ...

Each NAME is benchmarks/results/NAME.json (or a path to a .json).  Per file:
its commit, whether it completed, then per row the figures that carry the
comparison (ESM-2: unpadded tokens/s, the ratio to the strongest peer named,
to TE, to the fastest torchao float8 row (FP8 rows) and to length-grouped HF,
TE's attention backend; TE modules: ms of each
and seqfuse_vs_te; torchao: ms and the ratio to the best torchao row; Llama:
tokens/s and the ratio to the best transformers row; the attention probe:
each case's backend), errors and skips with their reason, and the goals that
failed.  A name without a file says so; an unknown kind of file gets its rows'
first fields.
"""
import json
import os
import sys

RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results")
WIDTH = 200


def _f(v, spec=".3g"):
    if isinstance(v, float):
        return format(v, spec)
    return str(v)


def _k(v):
    return f"{v / 1e3:.1f}k" if isinstance(v, (int, float)) else str(v)


def _attn(name):
    """TE's backend name without its enum's class prefix (FusedAttention (NVTE_F16_arbitrary_seqlen))."""
    return str(name).replace("NVTE_Fused_Attn_Backend.", "")


def _why(r):
    for key in ("error", "skipped", "te_skipped", "check_error", "seqfuse_error", "te_error"):
        if r.get(key):
            return f"{key}: {r[key]}"
    return ""


def esm2_line(r):
    if "unpadded_tokens_per_s" not in r:
        return f"{r.get('row')}: {_why(r)}"
    notes = r.get("notes") or {}
    parts = [f"{r['row']}: {_k(r['unpadded_tokens_per_s'])} tok/s",
             f"vs_best_peer {_f(r.get('vs_best_peer'))} ({r.get('best_peer', '')})",
             f"vs_te {_f(r.get('vs_te'))}", f"vs_hf {_f(r.get('vs_hf'))}", f"warm {_f(r.get('warm_s'), '.1f')} s"]
    if r.get("ao_peer"):  # an FP8 row against the fastest torchao float8 row (hfao)
        parts.insert(2, f"vs_ao {_f(r.get('vs_ao'))} ({r['ao_peer']})")
    if "te_attention" in notes:
        parts.append(f"attn {_attn(notes['te_attention'])}")
    if "recompiled_in_timed_pass" in notes:
        parts.append(f"RECOMPILED {notes['recompiled_in_timed_pass']}x in the timed pass")
    return ", ".join(parts)


def te_modules_line(r):
    head = f"{r.get('shape')} {r.get('module')} {r.get('recipe')}"
    if "seqfuse_vs_te" not in r:
        return f"{head}: seqfuse {_f(r.get('seqfuse_ms'))} ms; {_why(r)}"
    out = (f"{head}: seqfuse {_f(r['seqfuse_ms'])} / TE {_f(r['te_ms'])} ms, seqfuse_vs_te {_f(r['seqfuse_vs_te'])}"
           f", rel_diff {_f(r.get('rel_diff_bf16', r.get('rel_diff_fp8')))}")
    if "te_attention" in r:
        out += f", TE attn {_attn(r['te_attention'])}"
    return out


def torchao_line(r):
    head = f"{r.get('shape')} {r.get('module')} {r.get('impl')}"
    if "ms" not in r:
        return f"{head}: {_why(r)}"
    out = f"{head}: {_f(r['ms'])} ms"
    if "vs_best_torchao" in r:
        out += f", vs_best_torchao {_f(r['vs_best_torchao'])} ({r.get('best_torchao')})"
    if "vs_torch_compile_bf16" in r:
        out += f", vs_torch_compile_bf16 {_f(r['vs_torch_compile_bf16'])}"
    return out


def llama_line(r):
    if "unpadded_tokens_per_s" not in r:
        return f"{r.get('row')}: {_why(r)}"
    return (f"{r['row']}: {_k(r['unpadded_tokens_per_s'])} tok/s, vs_best_hf {_f(r.get('vs_best_hf'))} "
            f"({r.get('best_hf', '')}), vs_hf {_f(r.get('vs_hf'))}, step {_f(r.get('step_ms'), '.1f')} ms, "
            f"peak {_f(r.get('peak_mem_gib'), '.1f')} GiB, first loss {_f(r.get('first_loss'), '.4f')}"
            + (f"; {r['note']}" if r.get("note") else ""))


def liger_line(r):
    ratios = ", ".join(f"{k} {_f(v)}" for k, v in r.items() if k.startswith("seqfuse_vs_"))
    return f"{r.get('op')}: seqfuse {_f(r.get('seqfuse_ms'))} ms, {ratios or _why(r)}"


def probe_line(r):
    return f"{r.get('case')}: {_attn(r.get('backend') or r.get('error'))}"


def generic_line(r):
    return ", ".join(f"{k}={_f(v)}" for k, v in list(r.items())[:8])


KINDS = {"esm2": esm2_line, "te_modules": te_modules_line, "torchao": torchao_line, "llama3": llama_line,
         "liger": liger_line, "te_attention_probe": probe_line}


def line_for(name):
    """The row formatter for a result named ``name`` (by its prefix)."""
    for prefix, fn in sorted(KINDS.items(), key=lambda kv: -len(kv[0])):
        if os.path.basename(name).startswith(prefix):
            return fn
    return generic_line


def summarize(name, out=print):
    path = name if name.endswith(".json") else os.path.join(RESULTS, f"{name}.json")
    if not os.path.isfile(path):
        out(f"== {name}: no result file ({os.path.relpath(path)})")
        return None
    with open(path) as f:
        doc = json.load(f)
    run = doc.get("run") or {}
    head = (f"== {name}: commit {str(run.get('git_commit', '?'))[:12]}, "
            f"{'complete' if doc.get('complete') else 'INCOMPLETE (cut short or failed)'}, {len(doc.get('rows', []))} rows")
    for key in ("te_skipped", "torchao_skipped", "liger_skipped"):
        if doc.get(key):
            head += f"; {key}: {doc[key]}"
    if "torch_cudnn" in doc:
        head += f"; cuDNN torch {doc.get('torch_cudnn')} TE {doc.get('te_cudnn')}; fused_all {doc.get('fused_all')}"
    out(head[:WIDTH])
    fmt = line_for(name)
    for r in doc.get("rows", []):
        out("  " + fmt(r)[:WIDTH])
    goals = doc.get("goals") or []
    failed = [g for g in goals if not g.get("pass")]
    if goals:
        out(f"  goals: {len(goals) - len(failed)} of {len(goals)} pass" + ("; failed:" if failed else ""))
        for g in failed:
            out(f"    {g.get('goal')}: {_f(g.get('value'))} (need {g.get('need', '')})"[:WIDTH])
    check = doc.get("loss_check") or doc.get("sample_check")
    if isinstance(check, dict) and check.get("pass", check.get("same_samples", True)) is False:
        out(f"  CHECK FAILED: {json.dumps(check)[:WIDTH]}")
    return doc


def main(argv=None):
    names = sys.argv[1:] if argv is None else argv
    if not names:
        print(__doc__.strip().splitlines()[0])
        print("usage: python3 benchmarks/peers/summary.py NAME [NAME ...]")
        return 2
    for n in names:
        summarize(n)
    return 0


if __name__ == "__main__":
    sys.exit(main())
