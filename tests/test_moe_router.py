"""The MoE router ops (csrc/moe/, seqfuse.ops.moe): top-k with softmax or
sigmoid scores, the aux-loss scores, the load-balancing loss and the
z-loss, forward and backward, against plain float64 torch (the routing
choice is made on the float64 scores too, and must agree exactly); the
cuda-marked tests compare the kernels with the CPU backend."""
import pytest
import torch

from seqfuse.ops import moe

from helpers import REL_TOL, pair_tol, rel_error

CONFIGS = [  # (score_function, use_pre_softmax, topk, scaling, expert_bias)
    ("softmax", False, 2, None, False),
    ("softmax", True, 2, 1.5, False),
    ("softmax", False, 1, None, False),
    ("sigmoid", False, 2, None, False),
    ("sigmoid", False, 1, 2.0, False),
    ("sigmoid", False, 3, None, True),
]


def topk_mask(values, topk):
    """The topk largest of each row as a bool mask, ties to the lower index
    (the kernels' rule; bfloat16 logits do tie): a stable descending sort."""
    idx = torch.sort(values.detach(), dim=-1, descending=True, stable=True).indices[:, :topk]
    return torch.zeros(values.shape, dtype=torch.bool).scatter_(1, idx, True)


def topk_reference(logits, topk, score_function, pre, scaling, bias):
    """(probs, routing_map) in plain torch (differentiable in logits)."""
    if score_function == "softmax":
        scores = torch.softmax(logits, -1) if pre else logits
        sel = scores
    else:
        scores = torch.sigmoid(logits)
        sel = scores + (bias if bias is not None else 0)
    mask = topk_mask(sel, topk)
    if score_function == "softmax" and not pre:
        probs = torch.softmax(logits.masked_fill(~mask, float("-inf")), -1)
    else:
        probs = scores * mask
        if score_function == "sigmoid" and topk > 1:
            probs = probs / (probs.sum(-1, keepdim=True) + 1e-20)
    return probs * (1.0 if scaling is None else scaling), mask


def _logits(T, E, dtype, device="cpu"):
    return (torch.randn(T, E, dtype=torch.float64) * 2).to(dtype).to(device)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_topk_forward_backward_against_float64(config, dtype, seed):
    score, pre, topk, scaling, use_bias = config
    T, E = 37, 8
    logits = _logits(T, E, dtype).requires_grad_()
    bias = (torch.randn(E) * 0.1) if use_bias else None
    probs, rmap = moe.fused_topk_with_score_function(logits, topk, use_pre_softmax=pre, scaling_factor=scaling,
                                                     score_function=score, expert_bias=bias)
    ref_logits = logits.detach().double().requires_grad_()
    rprobs, rmask = topk_reference(ref_logits, topk, score, pre, scaling,
                                   None if bias is None else bias.double())
    assert torch.equal(rmap, rmask)
    assert probs.dtype == dtype and rmap.dtype == torch.bool
    assert rel_error(probs, rprobs) <= REL_TOL[dtype]
    g = torch.randn(T, E, dtype=torch.float64)
    (probs.double() * g).sum().backward()
    (rprobs * g).sum().backward()
    assert rel_error(logits.grad, ref_logits.grad) <= REL_TOL[dtype] * 2


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_aux_scores_against_float64(score, seed):
    T, E, topk = 29, 6, 2
    logits = _logits(T, E, torch.float32).requires_grad_()
    rmap, scores = moe.fused_compute_score_for_moe_aux_loss(logits, topk, score)
    ref_logits = logits.detach().double().requires_grad_()
    if score == "softmax":
        rs = torch.softmax(ref_logits, -1)
    else:
        s = torch.sigmoid(ref_logits)
        rs = s / (s.sum(-1, keepdim=True) + 1e-20)
    rmask = topk_mask(rs, topk)
    assert torch.equal(rmap, rmask) and scores.dtype == torch.float32
    assert rel_error(scores, rs) <= REL_TOL[torch.float32]
    g = torch.randn(T, E, dtype=torch.float64)
    (scores.double() * g).sum().backward()
    (rs * g).sum().backward()
    assert rel_error(logits.grad, ref_logits.grad) <= REL_TOL[torch.float32] * 2


@pytest.mark.parametrize("count_dtype", [torch.int32, torch.int64])
def test_aux_loss_against_float64(count_dtype, seed):
    T, E, topk, coeff = 50, 8, 2, 0.01
    probs = torch.rand(T, E).requires_grad_()
    tpe = torch.randint(0, 30, (E,), dtype=count_dtype)
    loss = moe.fused_moe_aux_loss(probs, tpe, T, E, topk, coeff)
    rp = probs.detach().double().requires_grad_()
    ref = (rp.sum(0) * tpe.double()).sum() * (E * coeff / (topk * T * T))
    assert loss.dtype == torch.float32 and loss.dim() == 0
    assert rel_error(loss, ref) <= REL_TOL[torch.float32]
    (loss * 3).backward()
    (ref * 3).backward()
    assert rel_error(probs.grad, rp.grad) <= REL_TOL[torch.float32]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_z_loss_against_float64(dtype, seed):
    T, E, coeff = 41, 16, 1e-3
    logits = _logits(T, E, dtype).requires_grad_()
    loss = moe.moe_z_loss(logits, coeff)
    rl = logits.detach().double().requires_grad_()
    ref = torch.logsumexp(rl, -1).square().mean() * coeff
    assert rel_error(loss, ref) <= REL_TOL[torch.float32]
    loss.backward()
    ref.backward()
    assert rel_error(logits.grad, rl.grad) <= REL_TOL[dtype]


def test_ties_go_to_the_lower_expert():
    logits = torch.zeros(3, 5)
    probs, rmap = moe.fused_topk_with_score_function(logits, 2, use_pre_softmax=True)
    assert rmap[:, :2].all() and not rmap[:, 2:].any()
    assert torch.allclose(probs[:, :2], torch.full((3, 2), 0.2))


def test_expert_bias_steers_selection_only():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    bias = torch.tensor([0.0, 0.0, 5.0, 5.0])
    probs, rmap = moe.fused_topk_with_score_function(logits, 2, score_function="sigmoid", expert_bias=bias)
    assert rmap.tolist() == [[False, False, True, True]]
    s = torch.sigmoid(logits[0, 2:])
    assert torch.allclose(probs[0, 2:], s / s.sum())


def test_router_errors_are_named():
    logits = torch.randn(4, 6)
    with pytest.raises(ValueError, match="topk"):
        moe.fused_topk_with_score_function(logits, 7)
    with pytest.raises(ValueError, match="score_function"):
        moe.fused_topk_with_score_function(logits, 2, score_function="relu")
    with pytest.raises(ValueError, match="sigmoid"):
        moe.fused_topk_with_score_function(logits, 2, expert_bias=torch.zeros(6))
    with pytest.raises(NotImplementedError, match="group-limited"):
        moe.fused_topk_with_score_function(logits, 2, num_groups=2, group_topk=1)
    with pytest.raises(ValueError, match="expert_bias.*length 6"):
        moe.fused_topk_with_score_function(logits, 2, score_function="sigmoid", expert_bias=torch.zeros(5))
    with pytest.raises(TypeError, match="logits"):
        moe.fused_topk_with_score_function(logits.double(), 2)
    with pytest.raises(ValueError, match="num_experts"):
        moe.fused_moe_aux_loss(logits, torch.zeros(6, dtype=torch.int64), 4, 5, 2, 0.1)
    with pytest.raises(TypeError, match="tokens_per_expert"):
        moe.fused_moe_aux_loss(logits, torch.zeros(6), 4, 6, 2, 0.1)
    with pytest.raises(ValueError, match="at least one token"):
        moe.moe_z_loss(torch.randn(0, 6), 0.1)


# ---- CUDA against the CPU reference ----------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 8), (4097, 8), (1000, 64), (333, 160)])
def test_cuda_topk_matches_cpu(config, dtype, shape, seed):
    score, pre, topk, scaling, use_bias = config
    T, E = shape
    logits = _logits(T, E, dtype)
    bias = (torch.randn(E) * 0.1) if use_bias else None
    g = torch.randn(T, E).to(dtype)
    outs = {}
    for dev in ("cpu", "cuda"):
        lg = logits.detach().to(dev, copy=True).requires_grad_()
        probs, rmap = moe.fused_topk_with_score_function(
            lg, topk, use_pre_softmax=pre, scaling_factor=scaling, score_function=score,
            expert_bias=None if bias is None else bias.to(dev))
        probs.backward(g.to(dev))
        outs[dev] = (probs.cpu(), rmap.cpu(), lg.grad.cpu())
    # the selection may differ where two scores are within rounding: compare on agreeing rows
    same = (outs["cpu"][1] == outs["cuda"][1]).all(-1)
    assert same.float().mean() > 0.99
    for i in range(3):
        a, b = outs["cuda"][i][same], outs["cpu"][i][same]
        if i == 1:
            assert torch.equal(a, b)
        else:
            assert rel_error(a, b.double()) <= pair_tol(dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_cuda_losses_match_cpu(score, seed):
    T, E, topk = 3000, 32, 4
    logits = _logits(T, E, torch.float32)
    results, tpe = {}, None
    for dev in ("cpu", "cuda"):
        lg = logits.detach().to(dev, copy=True).requires_grad_()
        rmap, scores = moe.fused_compute_score_for_moe_aux_loss(lg, topk, score)
        if tpe is None:  # the CPU's counts on both devices: a near-tie may select differently
            tpe = rmap.sum(0)
        aux = moe.fused_moe_aux_loss(scores, tpe.to(dev), T, E, topk, 0.01)
        z = moe.moe_z_loss(lg, 1e-3)
        (aux + z).backward()
        results[dev] = (rmap.cpu(), scores.detach().cpu(), aux.detach().cpu(), z.detach().cpu(), lg.grad.cpu())
    assert (results["cpu"][0] == results["cuda"][0]).all(-1).float().mean() >= 0.999
    # 10x the pair bound: the losses are float32 sums of 96,000 terms, added in
    # another order on the GPU (block partials, then atomics)
    for i in range(1, 5):
        assert rel_error(results["cuda"][i], results["cpu"][i].double()) <= pair_tol(torch.float32) * 10
