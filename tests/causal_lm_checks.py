"""Checks shared by the causal-LM family tests (test_hf_llama*.py,
test_hf_mixtral.py): the tiny batches they feed, and the claims every
seqfuse causal-LM family makes against transformers' model with the same
weights, each a function a family's test calls with its own models (so
each family keeps its test names and seeds, and a claim is written once).

``losses`` names the scalar outputs compared besides the logits ("loss",
and "aux_loss" for a mixture of experts)."""
import pytest
import torch

from helpers import rel_error

VOCAB = 16


def spread_weights(model, scale=5.0):
    """transformers' model with its norm weights moved away from 1 and every
    other weight times ``scale`` (in place, from the caller's seed), so that a
    dropped norm, a wrong head or expert order or a lost routing weight
    cannot pass a comparison unnoticed.  Returns the model."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(0.2 * torch.randn_like(p))
            else:
                p.mul_(scale)
    return model


def batch(lengths=(40, 29, 17), seed=0, vocab=VOCAB):
    """Right-padded ids (pad 0), mask, labels (-100 on padding) and the
    sequences themselves."""
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(1, vocab, (n,), generator=g) for n in lengths]
    s = max(lengths)
    ids = torch.zeros(len(seqs), s, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, x in enumerate(seqs):
        ids[i, :len(x)] = x
        mask[i, :len(x)] = 1
    return dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)), seqs


def packed(seqs):
    """The sequences packed (thd): ids, cu_seqlens (int32), restarting position ids."""
    cu = torch.tensor([0] + [len(x) for x in seqs]).cumsum(0).to(torch.int32)
    pos = torch.cat([torch.arange(len(x)) for x in seqs])
    return torch.cat(seqs), cu, pos


def real(t, mask):
    """The rows of ``t`` at the real (mask 1) tokens."""
    return t[mask.bool()]


def close(a, b, rel):
    """|a - b| <= rel * |b| for two scalar outputs."""
    return abs(a.item() - b.item()) <= rel * abs(b.item())


def hf_grads_in_seqfuse_names(hf, to_seqfuse, config):
    """transformers' gradients under seqfuse's names (``to_seqfuse``: the
    family's hf_to_seqfuse_state_dict)."""
    grads = {k: p.grad for k, p in hf.named_parameters() if p.grad is not None}
    return to_seqfuse(grads, config)


def check_grads(sf, hf, to_seqfuse, tol):
    """Every seqfuse parameter has a gradient within ``tol`` (relative) of
    transformers' for the same weight."""
    mapped = hf_grads_in_seqfuse_names(hf, to_seqfuse, sf.config)
    for name, p in sf.named_parameters():
        assert p.grad is not None, name
        assert rel_error(p.grad, mapped[name]) <= tol, (name, rel_error(p.grad, mapped[name]))


def check_bf16_within_bf16_rounding(hf16, hf32, sf, b, losses=("loss",)):
    """bf16 weights: seqfuse's (``sf``) and transformers' (``hf16``) bf16
    logits, each against transformers in float32 with the same
    (bf16-representable) weights (``hf32``).  Bound: seqfuse's error <=
    max(2 x transformers' own, 1e-2); each of ``losses`` within 1 %."""
    with torch.no_grad():
        ref, base, out = hf32(**b), hf16(**b), sf(**b)
    assert out.logits.dtype == torch.bfloat16
    m = b["attention_mask"]
    err_sf = rel_error(real(out.logits, m), real(ref.logits, m))
    err_hf = rel_error(real(base.logits, m), real(ref.logits, m))
    assert err_sf <= max(2 * err_hf, 1e-2), (err_sf, err_hf)
    for name in losses:
        assert close(getattr(out, name), getattr(ref, name), 1e-2), name


def check_packed_thd_matches_padded_bshd(sf, b, seqs, losses=("loss",)):
    """Packed (cu_seqlens, restarting position_ids, 1-D input, both
    together) gives the padded batch's logits of the real tokens and the
    same ``losses`` (every sequence's last token predicts nothing, as a
    padded row's; padding is in no loss); backward reaches every parameter."""
    padded = sf(**b)
    ids, cu, pos = packed(seqs)
    by_cu = sf(input_ids=ids[None], labels=ids[None], cu_seqlens=cu, max_seqlen=max(len(x) for x in seqs))
    assert by_cu.logits.shape == (1, ids.numel(), sf.config.vocab_size)
    assert rel_error(by_cu.logits[0], real(padded.logits, b["attention_mask"])) <= 1e-6
    for name in losses:
        assert close(getattr(by_cu, name), getattr(padded, name), 1e-6), name
    # restarting position ids alone (transformers' padding-free layout), 1-D input, both together
    by_pos = sf(input_ids=ids[None], labels=ids[None], position_ids=pos[None])
    assert torch.equal(by_pos.logits, by_cu.logits) and by_pos.loss.item() == by_cu.loss.item()
    flat = sf(input_ids=ids, labels=ids, cu_seqlens=cu, position_ids=pos)
    assert torch.equal(flat.logits, by_cu.logits[0])
    by_cu.loss.backward()
    assert all(p.grad is not None for p in sf.parameters())


def check_left_padding_matches_transformers(hf, sf, b, losses=()):
    """transformers' forward without position_ids takes the column index as
    position; so does seqfuse's, and left padding is computed exactly: the
    logits of the real tokens, and ``losses``, within 1e-5."""
    left = {k: torch.stack([torch.roll(r, int((b["attention_mask"][i] == 0).sum())) for i, r in enumerate(v)])
            for k, v in b.items()}
    with torch.no_grad():
        exp, out = hf(**left), sf(**left)
    m = left["attention_mask"]
    assert rel_error(real(out.logits, m), real(exp.logits, m)) <= 1e-5
    for name in losses:
        assert close(getattr(out, name), getattr(exp, name), 1e-5), name


def check_activation_checkpointing(sf, b):
    """gradient_checkpointing_enable: the same loss and bit-identical
    gradients as without it."""
    sf(**b).loss.backward()
    ref = {n: p.grad.clone() for n, p in sf.named_parameters()}
    sf.zero_grad()
    sf.gradient_checkpointing_enable()
    assert sf.is_gradient_checkpointing
    sf(**b).loss.backward()
    for n, p in sf.named_parameters():
        assert torch.equal(p.grad, ref[n]), n


def check_bad_inputs_named(sf, b, seqs, name):
    """What a seqfuse causal LM refuses, each error naming the model
    (``name``, e.g. "SeqfuseLlama", or its ForCausalLM class) and the
    argument: attention probabilities, a key/value cache, token types,
    labels of another shape, a packed batch with a mask, packed positions
    that do not restart, padded positions other than the column index,
    int64 cu_seqlens, packed ids with neither cu_seqlens nor positions,
    float ids, labels with logits_to_keep; and logits_to_keep=1 gives the
    last row of the full logits."""
    ids, cu, _ = packed(seqs)
    padded = b["input_ids"]
    refused = [  # (error, what its message says after the model's name, the call's arguments)
        (NotImplementedError, r"output_attentions", dict(b, output_attentions=True)),
        (NotImplementedError, r"use_cache", dict(b, use_cache=True)),
        (NotImplementedError, r"arguments \['token_type_ids'\]", dict(b, token_type_ids=torch.zeros_like(padded))),
        (ValueError, r"labels", dict(input_ids=padded, labels=b["labels"][:, :5])),
        (ValueError, r"packed input .* takes no attention_mask",
         dict(input_ids=ids, cu_seqlens=cu, attention_mask=torch.ones_like(ids))),
        (ValueError, r"position_ids must count",
         dict(input_ids=ids, cu_seqlens=cu, position_ids=torch.arange(ids.numel()))),
        (NotImplementedError, r"padded input .* position_ids",
         dict(input_ids=padded, position_ids=torch.arange(padded.shape[1]) + 1)),
        (TypeError, r"cu_seqlens", dict(input_ids=ids, cu_seqlens=cu.long())),
        (ValueError, r"1-D \(packed\) input_ids need cu_seqlens or position_ids", dict(input_ids=ids)),
        (TypeError, r"input_ids", dict(input_ids=padded.float())),
        (ValueError, r"labels need every position's logits \(logits_to_keep", dict(b, logits_to_keep=1)),
    ]
    for error, rule, kwargs in refused:
        with pytest.raises(error, match=f"{name}(ForCausalLM)?: {rule}"):
            sf(**kwargs)
    with torch.no_grad():
        last = sf(input_ids=padded, logits_to_keep=1).logits
        full = sf(input_ids=padded).logits
    assert rel_error(last, full[:, -1:]) <= 1e-6  # one GEMM row block fewer: rounding only


def check_round_trip(hf, from_hf_model, to_hf_model, dtype, tie):
    """transformers -> seqfuse -> transformers is bit-identical (every
    tensor, its dtype, the tie); returns (sf, back) for family-specific
    checks."""
    sf = from_hf_model(hf)
    assert {p.dtype for p in sf.parameters()} == {dtype}
    back = to_hf_model(sf)
    a, b = hf.state_dict(), back.state_dict()
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    assert (back.lm_head.weight is back.model.embed_tokens.weight) == tie
    return sf, back


def check_keys_match(hf_cls, sf_cls, tiny_config, from_hf_config, hf_keys, seqfuse_keys):
    """The family's key lists are exactly the two models' state-dict keys
    (lm_head.weight optional when tied), tied and untied."""
    for tie in (False, True):
        cfg = tiny_config(tie=tie)
        hf = hf_cls(cfg)
        sf = sf_cls(from_hf_config(cfg))
        optional = {"lm_head.weight"} if tie else set()
        assert set(hf.state_dict()) - optional == set(hf_keys(sf.config))
        assert set(sf.state_dict()) - optional == set(seqfuse_keys(sf.config))
