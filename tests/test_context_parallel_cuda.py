"""Context parallelism on GPUs over NCCL (cuda-marked; needs at least 2 GPUs).

The claim, as in test_context_parallel.py but in bf16 on the GPU: every
rank's out, dq, dk, dv under CP (p2p with and without a cp_stream, and
all_gather; bshd and thd; causal and full; GQA) are within bf16's error of
a float64 reference of full-sequence attention computed with plain torch
math, and the same tolerance as single-GPU seqfuse attention on the whole
sequence gets.  World sizes 2 and, where the machine has 4 GPUs, 4.

One spawn of `world` processes (NCCL, one GPU each) runs every case.
"""

import pytest
import torch
import torch.distributed as dist

import seqfuse.ops as ops
from helpers import BACKWARD_FACTOR, REL_TOL, rel_error, run_ranks, run_seed
from seqfuse.modules.attention import DotProductAttention
from seqfuse.distributed import context_parallel_attention, local_token_index

pytestmark = pytest.mark.cuda

HEADS, KV_HEADS = 8, 2
CASES = [(f, m, c) for f in ("bshd", "thd") for m in ("causal", "no_mask")
         for c in ("p2p", "p2p_stream", "all_gather")]


def _gpus():
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _lengths(fmt, world):
    m = 2 * world
    return [640 * m // 4, 96 * m, 1024 * m // 4, 0, 8 * m] if fmt == "thd" else [2048]


def _inputs(fmt, world, dim, seed, device):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    lens = _lengths(fmt, world)
    if fmt == "thd":
        t = sum(lens)
        qs, ks = (t, HEADS, dim), (t, KV_HEADS, dim)
        cu = torch.tensor([0] + torch.cumsum(torch.tensor(lens), 0).tolist(), dtype=torch.int32, device=device)
    else:
        qs, ks = (2, lens[0], HEADS, dim), (2, lens[0], KV_HEADS, dim)
        cu = None
    q, k, v, dout = (torch.randn(s, generator=gen).to(device, torch.bfloat16) for s in (qs, ks, ks, qs))
    return q, k, v, dout, cu


def _reference64(q, k, v, dout, fmt, causal, cu):
    """Plain-torch float64 attention over the whole sequence (per packed
    sequence for thd), with its gradients."""
    q, k, v = (x.double().requires_grad_() for x in (q, k, v))
    if fmt == "thd":  # [t, h, d] -> [1, t, h, d] with a block-diagonal mask
        seq = torch.repeat_interleave(torch.arange(len(cu) - 1, device=q.device), (cu[1:] - cu[:-1]).long())
        pos = torch.arange(q.shape[0], device=q.device)
        allowed = seq[:, None] == seq[None, :]
        if causal:
            allowed &= pos[None, :] <= pos[:, None]
        qb, kb, vb = (x.unsqueeze(0) for x in (q, k, v))
    else:
        s = q.shape[1]
        pos = torch.arange(s, device=q.device)
        allowed = (pos[None, :] <= pos[:, None]) if causal else torch.ones(s, s, dtype=torch.bool, device=q.device)
        qb, kb, vb = q, k, v
    rep = HEADS // KV_HEADS
    kb, vb = (x.repeat_interleave(rep, dim=2) for x in (kb, vb))
    scores = torch.einsum("bshd,bthd->bhst", qb, kb) / qb.shape[-1] ** 0.5
    scores = scores.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(scores, -1).nan_to_num(0.0)
    out = torch.einsum("bhst,bthd->bshd", p, vb)
    out = out.squeeze(0) if fmt == "thd" else out
    out.backward(dout.double())
    return out.detach(), q.grad, k.grad, v.grad


def _local(x, fmt, world, rank, cu):
    if fmt == "thd":
        return x.index_select(0, local_token_index((cu[1:] - cu[:-1]).long().cpu(), world, rank).to(x.device))
    return x.index_select(1, local_token_index(torch.tensor([x.shape[1]]), world, rank).to(x.device))


def _single_gpu(q, k, v, dout, fmt, causal, cu):
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    kw = dict(qkv_format=fmt, attn_mask_type="causal" if causal else "no_mask")
    if fmt == "thd":
        kw.update(cu_seqlens_q=cu, cu_seqlens_kv=cu)
    out = ops.attention(q, k, v, **kw)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _ranks_body(rank, world, seed):
    """Every case on GPU ``rank`` (run_ranks' body)."""
    group = dist.new_group(list(range(world)))
    device = torch.device("cuda", rank)
    stream = torch.cuda.Stream(device)
    results = {}
    for i, (fmt, mask, comm) in enumerate(CASES):
        for dim in (64, 128):
            q, k, v, dout, cu = _inputs(fmt, world, dim, seed + i, device)
            causal = mask == "causal"
            ref = _reference64(q, k, v, dout, fmt, causal, cu)
            single = _single_gpu(q, k, v, dout, fmt, causal, cu)
            ql, kl, vl, dl = (_local(x, fmt, world, rank, cu) for x in (q, k, v, dout))
            ql, kl, vl = (x.requires_grad_() for x in (ql, kl, vl))
            if comm == "p2p" and fmt == "bshd" and dim == 64:  # once through the module
                dpa = DotProductAttention(HEADS, dim, num_gqa_groups=KV_HEADS, qkv_format=fmt,
                                          attn_mask_type=mask)
                dpa.set_context_parallel_group(group, dist.get_process_group_ranks(group), None, "p2p")
                out = dpa(ql, kl, vl).view(ql.shape)
            else:
                out = context_parallel_attention(
                    ql, kl, vl, cp_group=group, cp_stream=stream if comm == "p2p_stream" else None,
                    cp_comm_type="all_gather" if comm == "all_gather" else "p2p", qkv_format=fmt,
                    attn_mask_type=mask, cu_seqlens_q=cu, cu_seqlens_kv=cu)
            out.backward(dl)
            got = (out.detach(), ql.grad, kl.grad, vl.grad)
            key = f"{fmt}-{mask}-{comm}-d{dim}"
            results[key] = {
                "cp": [rel_error(g, _local(r, fmt, world, rank, cu)) for g, r in zip(got, ref)],
                "single": [rel_error(_local(s, fmt, world, rank, cu), _local(r, fmt, world, rank, cu))
                           for s, r in zip(single, ref)],
            }
    return results


@pytest.fixture(scope="module")
def cuda_cp_results(tmp_path_factory):
    if _gpus() < 2:
        pytest.skip("context parallelism over NCCL needs at least 2 GPUs")
    seed = run_seed()
    return {world: run_ranks(_ranks_body, (seed,), world, tmp_path_factory.mktemp(f"cpcuda{world}"),
                             f"NCCL context-parallel workers (world size {world})", backend="nccl", store="tcp",
                             timeout=300)
            for world in (2, 4) if _gpus() >= world}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(c))
@pytest.mark.parametrize("dim", [64, 128])
def test_cuda_cp_matches_float64_reference(cuda_cp_results, world, case, dim):
    if world not in cuda_cp_results:
        pytest.skip(f"needs {world} GPUs")
    key = "-".join(case) + f"-d{dim}"
    for rank, res in enumerate(cuda_cp_results[world]):
        cp, single = res[key]["cp"], res[key]["single"]
        names = ("out", "dq", "dk", "dv")
        for i, name in enumerate(names):
            tol = REL_TOL[torch.bfloat16] * (1 if i == 0 else BACKWARD_FACTOR)
            assert cp[i] <= tol, (rank, name, cp[i], "single GPU:", single[i])
