"""seqfuse.hf.accelerate on transformers' mixture-of-experts models: the
stacked experts of Mixtral and Qwen3-MoE become SeqfuseExperts (permutation,
grouped GEMMs, scaled SwiGLU) with the same Parameters and state_dict keys,
the router left as transformers' (router logits and the load-balancing loss
unchanged); outputs, losses and every gradient match the original model;
experts the swap cannot compute are left with the reason."""
import copy
import os
import sys

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from seqfuse.hf import accelerate  # noqa: E402
from seqfuse.hf.fuse_experts import SeqfuseExperts, experts_refusal, probe_refusal  # noqa: E402
from helpers import rel_error  # noqa: E402

V = 128


def mixtral(seed=0, experts=4, topk=2, act="silu", dtype=torch.float32, device="cpu"):
    torch.manual_seed(seed)
    cfg = transformers.MixtralConfig(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=experts,
                                     num_experts_per_tok=topk, hidden_act=act, output_router_logits=True)
    cfg._experts_implementation = "eager"
    return transformers.MixtralForCausalLM(cfg).to(device, dtype)


def qwen3_moe(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.Qwen3MoeConfig(vocab_size=V, hidden_size=64, intermediate_size=128, moe_intermediate_size=48,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      head_dim=16, num_experts=6, num_experts_per_tok=2, norm_topk_prob=True,
                                      output_router_logits=True, decoder_sparse_step=1, mlp_only_layers=[])
    cfg._experts_implementation = "eager"
    return transformers.Qwen3MoeForCausalLM(cfg).float()


def check_same(ref, model, ids, tol):
    a, b = ref(ids, labels=ids), model(ids, labels=ids)
    assert rel_error(b.logits, a.logits) <= tol
    assert abs(b.loss.item() - a.loss.item()) <= tol * abs(a.loss.item())
    assert abs(b.aux_loss.item() - a.aux_loss.item()) <= tol * abs(a.aux_loss.item())
    a.loss.backward()
    b.loss.backward()
    for (n, p), (m, q) in zip(ref.named_parameters(), model.named_parameters()):
        assert n == m
        assert q.grad is not None, n
        assert rel_error(q.grad, p.grad) <= tol, n


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("experts,topk", [(4, 2), (8, 2), (3, 1)])
def test_mixtral_experts_swapped_exactly(seed, experts, topk):
    ref = mixtral(seed, experts, topk)
    model = copy.deepcopy(ref)
    params = {id(p) for p in model.parameters()}
    report = accelerate(model, fused_loss=False)
    swapped = [s for s in report.swapped if s.replacement.startswith("SeqfuseExperts")]
    assert [s.name for s in swapped] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert all(isinstance(layer.mlp.experts, SeqfuseExperts) for layer in model.model.layers)
    # the router is transformers' (its logits recorded for the aux loss)
    assert "model.layers.0.mlp.gate" in report.left_names()
    # the very Parameters and keys: an optimizer built before still trains them
    assert {id(p) for p in model.parameters()} == params
    assert list(model.state_dict()) == list(ref.state_dict())
    ids = torch.randint(0, V, (2, 13), generator=torch.Generator().manual_seed(seed))
    check_same(ref, model, ids, 1e-5)


def test_an_expert_with_no_tokens_and_padding_mask():
    """Routing forced onto two of four experts (the others get no rows), with
    a left-padded attention mask: still the original's outputs and gradients."""
    ref = mixtral(3)
    with torch.no_grad():
        for layer in ref.model.layers:
            layer.mlp.gate.weight[2:] = -10.0 * layer.mlp.gate.weight[2:].abs() - 1.0
            layer.mlp.gate.weight[:2] = 0.0
    model = copy.deepcopy(ref)
    accelerate(model, fused_loss=False)
    ids = torch.randint(0, V, (2, 9))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    a, b = ref(ids, attention_mask=mask), model(ids, attention_mask=mask)
    assert rel_error(b.logits[mask.bool()], a.logits[mask.bool()]) <= 1e-5


def test_qwen3_moe_experts_swapped_exactly():
    ref = qwen3_moe()
    model = copy.deepcopy(ref)
    report = accelerate(model, fused_loss=False)
    assert sum(s.replacement.startswith("SeqfuseExperts") for s in report.swapped) == 2
    check_same(ref, model, torch.randint(0, V, (2, 11)), 1e-5)


def test_bf16_within_bf16_rounding():
    ref = mixtral(4, dtype=torch.bfloat16)
    model = copy.deepcopy(ref)
    accelerate(model, fused_loss=False)
    ref32 = mixtral(4)  # the float32 model of the same weights: the reference both are measured against
    ids = torch.randint(0, V, (2, 13))
    want = ref32(ids).logits
    err_seqfuse = rel_error(model(ids).logits.float(), want)
    err_torch = rel_error(ref(ids).logits.float(), want)
    assert err_seqfuse <= max(2 * err_torch, 1e-2), (err_seqfuse, err_torch)


def test_optimizer_built_before_accelerate_trains_the_experts():
    model = mixtral(5)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.model.layers[0].mlp.experts.gate_up_proj.detach().clone()
    accelerate(model, fused_loss=False)
    ids = torch.randint(0, V, (2, 7))
    model(ids, labels=ids).loss.backward()
    opt.step()
    assert not torch.equal(model.model.layers[0].mlp.experts.gate_up_proj, before)


def test_experts_left_with_reasons():
    model = mixtral(6, act="gelu")
    report = accelerate(model, fused_loss=False)
    assert "not SiLU" in report.reason("model.layers.0.mlp.experts")
    assert not isinstance(model.model.layers[0].mlp.experts, SeqfuseExperts)
    model = mixtral(7)
    report = accelerate(model, fused_loss=False, fuse_experts=False)
    assert not any(isinstance(layer.mlp.experts, SeqfuseExperts) for layer in model.model.layers)
    with pytest.raises(TypeError, match="fuse_experts"):
        accelerate(mixtral(7), fuse_experts=1)


class OddExperts(nn.Module):
    """Shaped like transformers' experts but computing something else (the
    probe must catch it): the routing weight applied twice."""

    def __init__(self, E=3, H=8, F=5, extra=False):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(E, 2 * F, H))
        self.down_proj = nn.Parameter(torch.randn(E, H, F))
        self.act_fn = nn.SiLU()
        if extra:
            self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x, idx, w):
        out = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for j in range(idx.shape[1]):
                e = int(idx[t, j])
                g, u = (self.gate_up_proj[e] @ x[t]).chunk(2)
                out[t] += w[t, j] ** 2 * (self.down_proj[e] @ (self.act_fn(g) * u))
        return out


def test_refusal_rules_and_probe():
    assert "parameters beyond" in experts_refusal(OddExperts(extra=True))
    assert experts_refusal(OddExperts()) is None
    assert "probe: relative difference" in probe_refusal(OddExperts())
    bad = OddExperts()
    bad.down_proj = nn.Parameter(torch.randn(3, 8, 4))
    assert "[E, 2F, H]" in experts_refusal(bad)
    holder = nn.Module()
    holder.experts = OddExperts()
    report = accelerate(holder, attention=False, fuse_layers=False, fused_loss=False)
    assert "probe" in report.reason("experts")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_mixtral_matches_transformers(dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    # float32 compares exact float32 (another test in the process may have turned TF32 on)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        _mixtral_matches_transformers(dtype)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


def _mixtral_matches_transformers(dtype):
    ref = mixtral(8, experts=8, dtype=dtype, device="cuda")
    model = copy.deepcopy(ref)
    report = accelerate(model, fused_loss=False)
    assert sum(s.replacement.startswith("SeqfuseExperts") for s in report.swapped) == 2
    ids = torch.randint(0, V, (4, 64), device="cuda")
    a, b = ref(ids, labels=ids), model(ids, labels=ids)
    a.loss.backward()
    b.loss.backward()
    if dtype == torch.float32:
        # the project's bound: at most twice transformers' own float32 error against float64
        exact = copy.deepcopy(ref).double()
        for p in exact.parameters():
            p.grad = None
        e = exact(ids, labels=ids)
        e.loss.backward()
        for what, x_sf, x_hf, x64 in [("logits", b.logits, a.logits, e.logits), ("loss", b.loss, a.loss, e.loss)] + \
                [(n, q.grad, p.grad, r.grad) for (n, p), (_, q), (_, r) in
                 zip(ref.named_parameters(), model.named_parameters(), exact.named_parameters())]:
            err_sf, err_hf = rel_error(x_sf.double(), x64), rel_error(x_hf.double(), x64)
            assert err_sf <= max(2 * err_hf, 1e-5), (what, err_sf, err_hf)
        return
    tol = 3e-2
    assert rel_error(b.logits.float(), a.logits.float()) <= tol
    assert abs(b.loss.item() - a.loss.item()) <= tol * a.loss.item()
    for (n, p), (_, q) in zip(ref.named_parameters(), model.named_parameters()):
        assert rel_error(q.grad.float(), p.grad.float()) <= 0.1, n