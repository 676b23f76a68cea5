"""A whole Llama (seqfuse.hf.SeqfuseLlamaForCausalLM) under context
parallelism equals the same model on one process, on the CPU over gloo.

The claim: with set_context_parallel_group on the model (every layer under
CP, RoPE turning each local token by its full-sequence position), each rank
fed its load-balanced share of the batch (targets shifted over the full
sequences first, each packed sequence padded to a multiple of 2*cp) returns
the loss of the whole batch, and the mean over the CP ranks of every
parameter's gradient is the single-process gradient; within float32
rounding (REL_TOL[float32] for the loss, x BACKWARD_FACTOR for gradients), for
padded bshd (one row right-padded: the CP run has no mask, the reference
has) and packed thd (uneven lengths that need the CP padding), cp_comm_type
p2p and all_gather, tied embeddings.  Also: a model whose CP group is
reset runs plain again, shift_labels without CP equals labels, and the
refusals under CP (labels, attention_mask, position_ids) name the argument.

One start of 2 worker processes (forkserver with torch and seqfuse.hf
preloaded) runs every case; the tests read the saved errors.  A cuda-marked
test does the same over NCCL on two GPUs (float32) against the same model
on one GPU.
"""

import pytest
import torch
import torch.distributed as dist

from helpers import BACKWARD_FACTOR, REL_TOL, rel_error, run_ranks, run_seed

pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

WORLD = 2
CASES = [(f, c) for f in ("bshd", "thd") for c in ("p2p", "all_gather")]


def _model(dtype=torch.float32, device="cpu"):
    from seqfuse.hf import SeqfuseLlamaConfig, SeqfuseLlamaForCausalLM

    cfg = SeqfuseLlamaConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                             tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                             rope_parameters=dict(rope_type="default", rope_theta=10000.0))
    torch.manual_seed(0)  # the same weights on every rank
    with torch.device(device):
        model = SeqfuseLlamaForCausalLM(cfg)
    return model.to(dtype)


def _batch(fmt, seed, device="cpu"):
    """A full batch: bshd [2, 16] with the second row right-padded after 11
    tokens (attention_mask, labels -100 there); thd three packed sequences of
    9, 4 and 7 tokens (not multiples of 2*cp: the CP run pads them)."""
    g = torch.Generator().manual_seed(seed)
    if fmt == "bshd":
        ids = torch.randint(3, 16, (2, 16), generator=g)
        mask = torch.ones(2, 16, dtype=torch.long)
        mask[1, 11:] = 0
        ids[1, 11:] = 0
        labels = ids.masked_fill(mask == 0, -100)
        return dict(input_ids=ids.to(device), attention_mask=mask.to(device), labels=labels.to(device))
    lens = [9, 4, 7]
    ids = torch.randint(3, 16, (sum(lens),), generator=g)
    cu = torch.tensor([0, 9, 13, 20], dtype=torch.int32)
    return dict(input_ids=ids.to(device), labels=ids.clone().to(device), cu_seqlens=cu.to(device))


def _cp_share(batch, fmt, cp, rank):
    """This rank's share: targets shifted over the full sequences, the
    sequences padded for CP, the load-balanced split (what the recipe's
    loader does before the model)."""
    from seqfuse.hf.llama import shift_labels
    from seqfuse.distributed import pad_thd_sequences_for_cp, split_batch_for_cp_rank

    ids, cu = batch["input_ids"], batch.get("cu_seqlens")
    targets = shift_labels(batch["labels"], cu)
    if fmt == "thd":
        ids, targets, cu = pad_thd_sequences_for_cp(ids, targets, cu, cp)
    s = split_batch_for_cp_rank(ids, targets, None, cu, cp_size=cp, cp_rank=rank, qkv_format=fmt)
    kw = dict(cu_seqlens=cu) if fmt == "thd" else {}
    return dict(input_ids=s.input_ids, shift_labels=s.labels, **kw)


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _compare(fmt, comm, group, rank, seed, dtype=torch.float32, device="cpu"):
    """[loss error, max gradient error, name of the worst parameter]."""
    model = _model(dtype, device)
    batch = _batch(fmt, seed, device)
    ref = model(**batch)
    ref.loss.backward()
    want = _grads(model)
    model.zero_grad(set_to_none=True)

    model.set_context_parallel_group(group, None, None, comm)
    out = model(**_cp_share(batch, fmt, dist.get_world_size(group), rank))
    out.loss.backward()
    got = _grads(model)
    for g in got.values():  # the data-parallel mean over the CP group
        dist.all_reduce(g, group=group)
        g /= dist.get_world_size(group)
    errs = {n: rel_error(got[n], want[n]) for n in want}
    worst = max(errs, key=errs.get)
    # reset: the same model runs plain again
    model.set_context_parallel_group(None, None, None, comm)
    again = model(**batch).loss
    return [rel_error(out.loss, ref.loss), errs[worst], worst, rel_error(again, ref.loss), len(want)]


def _refusals(group, rank):
    """Arguments refused under CP, and shift_labels without CP."""
    model = _model()
    batch = _batch("bshd", 1)
    plain = model(**batch).loss
    from seqfuse.hf.llama import shift_labels

    shifted = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                    shift_labels=shift_labels(batch["labels"])).loss
    out = {"shift_labels_plain": rel_error(shifted, plain)}
    model.set_context_parallel_group(group, None, None, "p2p")
    share = _cp_share(batch, "bshd", WORLD, rank)
    for name, kw in (("labels", dict(input_ids=share["input_ids"], labels=share["shift_labels"])),
                     ("attention_mask", dict(share, attention_mask=torch.ones_like(share["input_ids"]))),
                     ("position_ids", dict(share, position_ids=torch.zeros_like(share["input_ids"])))):
        try:
            model(**kw)
            out[name] = "no error"
        except ValueError as e:
            out[name] = str(e)
    return out


def _ranks_body(rank, world, seed, device="cpu"):
    """Every case on this rank (run_ranks' body); ``device`` "cuda" runs on GPU ``rank``."""
    group = dist.new_group(list(range(world)))
    dev = f"cuda:{rank}" if device == "cuda" else device
    res = {f"{f}-{c}": _compare(f, c, group, rank, seed + i, device=dev) for i, (f, c) in enumerate(CASES)}
    if device == "cpu":
        res["refusals"] = _refusals(group, rank)
    return res


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(_ranks_body, (run_seed(),), WORLD, tmp_path_factory.mktemp("llama_cp"),
                     "Llama context-parallel workers", timeout=180, preload=("torch", "seqfuse", "seqfuse.hf"))


@pytest.mark.parametrize("case", [f"{f}-{c}" for f, c in CASES])
def test_llama_cp2_equals_cp1(results, case):
    """Loss on every rank and the CP-mean gradient of every parameter equal
    the single-process run's (float32)."""
    for rank, res in enumerate(results):
        e_loss, e_grad, worst, e_again, n_params = res[case]
        assert n_params >= 10, n_params
        assert e_loss <= REL_TOL[torch.float32], (rank, e_loss)
        assert e_grad <= REL_TOL[torch.float32] * BACKWARD_FACTOR, (rank, worst, e_grad)
        assert e_again <= REL_TOL[torch.float32], (rank, "after reset", e_again)


def test_llama_cp_refusals_and_shift_labels(results):
    for res in results:
        r = res["refusals"]
        assert r["shift_labels_plain"] <= REL_TOL[torch.float32], r
        assert "shift_labels" in r["labels"], r["labels"]
        assert "attention_mask must be None" in r["attention_mask"], r["attention_mask"]
        assert "position_ids must be None" in r["position_ids"], r["position_ids"]


# ---- two GPUs over NCCL ----------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_llama_cp2_equals_cp1_nccl(tmp_path):
    """The same equalities over NCCL on two GPUs (float32 parameters): loss
    and CP-mean gradients of every parameter against the same model on one
    GPU, within 1e-4 (loss) and 2e-3 (gradients), which leaves room for
    TF32 in the GPU's float32 GEMMs (the two runs' attention differs in its
    merge order, and the difference passes through them)."""
    results = run_ranks(_ranks_body, (1234, "cuda"), 2, tmp_path, "Llama context-parallel NCCL workers",
                        backend="nccl", timeout=300)
    for r, res in enumerate(results):
        for case, (e_loss, e_grad, worst, e_again, _) in res.items():
            assert e_loss <= 1e-4, (r, case, e_loss)
            assert e_grad <= 2e-3, (r, case, worst, e_grad)
            assert e_again <= 1e-4, (r, case, e_again)
