"""ESM-2 built from Transformer Engine's own modules, laid out as NVIDIA's
BioNeMo recipes lay it out (bionemo-recipes/models/esm2, NVEsmForMaskedLM),
so that bench_esm2.py can time the incumbent's model beside seqfuse's on the
same batches, weights and optimizer.

Layout (what BioNeMo's model does, rewritten here for the benchmark):
  * word embeddings over a vocabulary padded to 64 rows (FP8-friendly), ESM's
    token-dropout rescaling (per sequence: packed batches use cu_seqlens);
  * te.TransformerLayer per layer: encoder, pre-LayerNorm, fused QKV with
    interleaved heads, GELU (TE's tanh form, BioNeMo's "gelu"), rotary
    embeddings from TE's RotaryPositionEmbedding; the packed layout feeds
    it "thd" input with cu_seqlens (self_attn_mask_type "padding"), the
    padded layout "bshd" with TE's boolean mask, a fixed-length batch
    "bshd" with "no_mask";
  * te.LayerNorm after the last layer; LM head te.Linear -> GELU ->
    te.LayerNormLinear decoder (tied to the word embeddings) with FP8 off,
    as BioNeMo keeps the head in high precision;
  * loss: cross entropy over the 33 real vocabulary columns.

``from_seqfuse(model, ...)`` copies every weight of a SeqfuseEsmForMaskedLM
(whose layer parameters carry TE's names) so both start from the same
weights; a TE parameter left unassigned raises KeyError naming it.
Differences from seqfuse's model, stated: the MLP's GELU is the tanh form
(seqfuse's ESM default is erf-GELU), the LM head runs in bf16 under every
recipe (seqfuse's head dense layer follows the autocast).
"""
import torch
import torch.nn.functional as F
from torch import nn

#: ESM's token-dropout training mask ratio (15 % selected x 80 % replaced by <mask>).
MASK_RATIO_TRAIN = 0.15 * 0.8
PADDED_VOCAB = 64


def te_modules():
    """transformer_engine.pytorch and its RotaryPositionEmbedding (ImportError where TE does not import)."""
    import transformer_engine.pytorch as te
    from transformer_engine.pytorch.attention.rope import RotaryPositionEmbedding

    return te, RotaryPositionEmbedding


def te_autocast(enabled, recipe):
    """TE's FP8 context: ``autocast(recipe=)`` where this TE has it, else ``fp8_autocast(fp8_recipe=)``."""
    te, _ = te_modules()
    if hasattr(te, "autocast"):
        return te.autocast(enabled=enabled, recipe=recipe)
    return te.fp8_autocast(enabled=enabled, fp8_recipe=recipe)


def te_attention_backend():
    """Which attention TE's DotProductAttention last chose in this process:
    "FusedAttention (<cuDNN sub-backend>)", "FlashAttention (<version>)" or
    "UnfusedDotProductAttention" (the slow fallback, which a TE row must name:
    it is what the session-10 rows ran when TE loaded another cuDNN than
    torch's), else "unknown (<why>)".  Read from TE's own record of its last
    selection (dot_product_attention._attention_backends, TE 2.x), right after
    the row's attention ran."""
    try:
        from transformer_engine.pytorch.attention.dot_product_attention import dot_product_attention as dpa
    except ImportError as e:
        return f"unknown (TE's backend record not importable: {type(e).__name__}: {e})"
    b = getattr(dpa, "_attention_backends", None)
    if not isinstance(b, dict):
        return "unknown (this TE keeps no _attention_backends record)"
    if b.get("use_flash_attention"):
        return f"FlashAttention ({b.get('flash_attention_backend')})"
    if b.get("use_fused_attention"):
        return f"FusedAttention ({b.get('fused_attention_backend')})"
    if b.get("use_unfused_attention"):
        return "UnfusedDotProductAttention"
    return "unknown (no attention selection recorded yet)"


def te_recipe(name):
    """TE's recipe object for a bench recipe name (None for bf16), each with TE's defaults."""
    if name == "bf16":
        return None
    from transformer_engine.common import recipe as r

    return {"fp8_delayed": r.DelayedScaling, "fp8_current": r.Float8CurrentScaling,
            "fp8_block": r.Float8BlockScaling}[name]()


class TeEsmForMaskedLM(nn.Module):
    """ESM-2 masked LM on Transformer Engine modules (see the module note).
    ``layout``: "thd" (packed input) or "bshd" (padded or fixed-length)."""

    def __init__(self, config, layout, dtype=torch.bfloat16, device="cuda"):
        super().__init__()
        if layout not in ("thd", "bshd"):
            raise ValueError(f"TeEsmForMaskedLM: layout must be 'thd' or 'bshd', got {layout!r}")
        te, Rope = te_modules()
        self.config, self.layout = config, layout
        h, heads = config.hidden_size, config.num_attention_heads
        self.word_embeddings = nn.Embedding(PADDED_VOCAB, h, padding_idx=config.pad_token_id, dtype=dtype,
                                            device=device)
        self.layers = nn.ModuleList([
            te.TransformerLayer(
                hidden_size=h, ffn_hidden_size=config.intermediate_size, num_attention_heads=heads,
                num_gqa_groups=heads, layernorm_epsilon=config.layer_norm_eps,
                hidden_dropout=config.hidden_dropout_prob, attention_dropout=config.attention_probs_dropout_prob,
                qkv_weight_interleaved=True, fuse_qkv_params=True, layer_number=i + 1, layer_type="encoder",
                self_attn_mask_type="padding", activation="gelu", attn_input_format=layout,
                window_size=(-1, -1), params_dtype=dtype, device=device)
            for i in range(config.num_hidden_layers)])
        self.emb_layer_norm_after = te.LayerNorm(h, eps=config.layer_norm_eps, params_dtype=dtype, device=device)
        self.rotary = Rope(h // heads).to(device)  # its angle table on the GPU: no host copy per step
        self.dense = te.Linear(h, h, params_dtype=dtype, device=device)
        self.decoder = te.LayerNormLinear(h, PADDED_VOCAB, bias=True, eps=config.layer_norm_eps, params_dtype=dtype,
                                          device=device)
        self.decoder.weight = self.word_embeddings.weight  # tied, as ESM-2 and BioNeMo's model

    def _embed(self, input_ids, attention_mask, cu_seqlens):
        cfg = self.config
        emb = self.word_embeddings(input_ids)
        is_mask = input_ids == cfg.mask_token_id
        emb = emb.masked_fill(is_mask.unsqueeze(-1), 0.0)
        if cu_seqlens is not None:
            lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
            seq_of_token = torch.repeat_interleave(torch.arange(lengths.numel(), device=emb.device), lengths,
                                                   output_size=input_ids.numel())
            n_mask = torch.zeros(lengths.numel(), device=emb.device).index_add_(0, seq_of_token, is_mask.float())
            scale = (1 - MASK_RATIO_TRAIN) / (1 - n_mask / lengths.clamp(min=1))
            emb = (emb * scale[seq_of_token].unsqueeze(-1)).to(emb.dtype)
        else:
            src = attention_mask.sum(-1) if attention_mask is not None else input_ids.shape[1]
            scale = (1 - MASK_RATIO_TRAIN) / (1 - is_mask.sum(-1).float() / src)
            emb = (emb * scale[:, None, None]).to(emb.dtype)
            if attention_mask is not None:
                emb = (emb * attention_mask.unsqueeze(-1)).to(emb.dtype)
        return emb

    def forward(self, input_ids, labels, attention_mask=None, cu_seqlens=None, max_seqlen=None):
        if (cu_seqlens is not None) != (self.layout == "thd"):
            raise ValueError(f"TeEsmForMaskedLM({self.layout!r}): packed input needs cu_seqlens and the 'thd' "
                             "layout; padded input the 'bshd' layout")
        if cu_seqlens is not None:
            ids = input_ids.reshape(-1)
            x = self._embed(ids, None, cu_seqlens)
            freqs = self.rotary(int(max_seqlen)).to(x.device)
            kw = dict(cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens, max_seqlen_q=int(max_seqlen),
                      max_seqlen_kv=int(max_seqlen))
        else:
            ids = input_ids
            x = self._embed(ids, attention_mask, None)
            freqs = self.rotary(ids.shape[1]).to(x.device)
            if attention_mask is None:
                kw = dict(self_attn_mask_type="no_mask")
            else:
                kw = dict(attention_mask=~attention_mask.bool()[:, None, None, :], self_attn_mask_type="padding")
        for layer in self.layers:
            x = layer(x, rotary_pos_emb=freqs, **kw)
        x = self.emb_layer_norm_after(x)
        with te_autocast(False, None):  # the head in high precision, as BioNeMo's model
            logits = self.decoder(F.gelu(self.dense(x)))
        v = self.config.vocab_size
        loss = F.cross_entropy(logits[..., :v].reshape(-1, v).float(), labels.reshape(-1), ignore_index=-100)
        return _Output(loss)


class _Output:
    """The one field the benchmark reads (transformers' outputs carry ``.loss`` too)."""

    def __init__(self, loss):
        self.loss = loss


def from_seqfuse(sf_model, layout, dtype=torch.bfloat16, device="cuda"):
    """A TeEsmForMaskedLM holding exactly the weights of ``sf_model``
    (a SeqfuseEsmForMaskedLM), vocabulary rows past the real ones zero."""
    cfg = sf_model.config
    if cfg.emb_layer_norm_before:
        raise NotImplementedError("from_seqfuse: ESM configs with emb_layer_norm_before (ESM-1b) are not built here")
    model = TeEsmForMaskedLM(cfg, layout, dtype=dtype, device=device)
    src = {k: v for k, v in sf_model.state_dict().items() if not k.endswith("_extra_state")}
    v = cfg.vocab_size
    with torch.no_grad():
        for name, p in model.named_parameters(remove_duplicate=False):
            if name.startswith("layers."):
                key = "esm.encoder." + name
            elif name.startswith("emb_layer_norm_after."):
                key = "esm.encoder." + name
            elif name.startswith("dense."):
                key = "lm_head." + name
            elif name == "decoder.layer_norm_weight":
                key = "lm_head.layer_norm.weight"
            elif name == "decoder.layer_norm_bias":
                key = "lm_head.layer_norm.bias"
            elif name == "decoder.bias":
                key = "lm_head.bias"
            elif name in ("word_embeddings.weight", "decoder.weight"):
                key = "esm.embeddings.word_embeddings.weight"
            else:
                raise KeyError(f"from_seqfuse: no seqfuse weight is mapped to TE parameter {name!r}")
            if key not in src:
                raise KeyError(f"from_seqfuse: seqfuse model has no {key!r} (for TE parameter {name!r})")
            w = src[key]
            if w.shape[0] == v and p.shape[0] == PADDED_VOCAB:  # the padded vocabulary rows
                p.zero_()
                p[:v].copy_(w)
            elif w.shape != p.shape:
                raise ValueError(f"from_seqfuse: {key} {tuple(w.shape)} does not fit TE's {name} {tuple(p.shape)}")
            else:
                p.copy_(w)
    return model
