"""The LM head and cross-entropy of a transformers causal LM as one chunked
fused linear cross-entropy, used by ``seqfuse.hf.accelerate``.

transformers' ``LlamaForCausalLM.forward(labels=...)`` (Mistral, Qwen2,
Qwen3, Gemma and Phi-3 alike) computes the logits of every position ([tokens, vocabulary]:
gigabytes at a 128k vocabulary), upcasts them to float32 and then takes the
cross-entropy.  After ``wrap_causal_lm_loss(model)``, a call with ``labels``
runs the base model, then seqfuse.modules.cross_entropy.linear_cross_entropy
over the final hidden states and the LM head's weight: a chunk of tokens at a
time, the gradients made in the forward, so no full logits ever exist.  The
loss is transformers' ForCausalLMLoss: labels shifted by one (or
``shift_labels`` as given), -100 (or ``ignore_index``) ignored, the mean over
the predicted tokens, or the sum divided by ``num_items_in_batch`` when given.

Where the input embedding shares its weight with the LM head (tied
embeddings, e.g. Llama 3.2 1B), a labels call looks the tokens up through
seqfuse.modules.tied_embedding and passes the result as ``inputs_embeds``:
the embedding's backward adds its token rows into the head gradient the
fused loss made, instead of a dense gradient of its own that autograd adds
to it (seqfuse.modules.embedding says why).  An embedding of another type,
with hooks (other than transformers' make_inputs_require_grads), max_norm,
scale_grad_by_freq or sparse gradients keeps transformers' own lookup (each
call checks; the first refusal of each reason is logged), as does a call
that gives inputs_embeds.

What changes for the caller: ``logits`` in the output is None when labels
are given (as with Liger-Kernel's fused loss); calls without labels run
transformers' own forward, logits included.  A labels call with
``logits_to_keep`` other than 0 runs transformers' own forward too (logged).

Not wrapped (the report's ``loss`` line says why): models other than these
causal LMs, an LM head that is not a linear layer, a final logit
soft-capping, or a loss function other than transformers' ForCausalLM loss.
"""
import inspect
import logging

import torch
import torch.nn.functional as F
from torch import nn

from ..modules.cross_entropy import linear_cross_entropy
from ..modules.embedding import TiedGradient, tied_embedding
from .method_wrap import forward_signature, wrap_method_once

_log = logging.getLogger("seqfuse")

#: causal-LM classes whose forward is base model -> lm_head -> ForCausalLMLoss
CAUSAL_LMS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "GemmaForCausalLM",
              "Phi3ForCausalLM")

OWN = "transformers' own LM head and loss"
_FP8_HEAD = "_seqfuse_fp8_lm_head"  # model.__dict__ key: the recipe of the loss's FP8 GEMMs (set_fp8_head)


def set_fp8_head(model, recipe):
    """Run the fused loss's LM-head GEMMs in FP8 under ``recipe`` (a
    per-tensor recipe: seqfuse.modules.cross_entropy.linear_cross_entropy's
    fp8_recipe) from now on."""
    model.__dict__[_FP8_HEAD] = recipe


def _refusal(model):
    cls = type(model).__name__
    if cls not in CAUSAL_LMS or not type(model).__module__.startswith("transformers.models."):
        return f"{cls} is not one of {', '.join(CAUSAL_LMS)}"
    head = getattr(model, "lm_head", None)
    w = getattr(head, "weight", None)
    if not isinstance(head, nn.Module) or not isinstance(w, torch.Tensor) or w.dim() != 2:
        return "the model has no linear lm_head"
    if head._forward_hooks or head._forward_pre_hooks or hasattr(head, "parametrizations"):
        return "lm_head has hooks or parametrizations, which the fused loss would skip"
    if type(head).__name__ not in ("Linear",):
        return f"lm_head is a {type(head).__name__}, not a linear layer"
    if getattr(model.config, "final_logit_softcapping", None):
        return "the model soft-caps its logits (final_logit_softcapping)"
    try:
        from transformers.loss.loss_utils import LOSS_MAPPING
    except ImportError:
        return "transformers' loss mapping (transformers.loss.loss_utils) is not importable"
    if model.loss_function is not LOSS_MAPPING.get("ForCausalLM"):
        return "the model's loss_function is not transformers' ForCausalLMLoss"
    return None


def _output_cache_field(output_cls):
    fields = getattr(output_cls, "__dataclass_fields__", {})
    return "cache" if "cache" in fields else "past_key_values"


_NOT_TIED = "the input embedding and the LM head do not share their weight"


def _tie_refusal(model, emb):
    """Why the model's input embedding ``emb`` is not looked up through
    tied_embedding (None: it is): the head and the embedding must share one
    plain leaf weight, and the embedding be a plain torch.nn.Embedding."""
    w = getattr(model.lm_head, "weight", None)
    if getattr(emb, "weight", None) is not w:
        return _NOT_TIED
    if type(emb) is not nn.Embedding:
        return f"the input embedding is a {type(emb).__name__}, not a torch.nn.Embedding"
    # (transformers' gradient checkpointing registers make_inputs_require_grads, which sets requires_grad on the
    # lookup's output: already so where the shared weight requires grad, so it changes nothing here)
    hooks = [h for h in emb._forward_hooks.values() if getattr(h, "__name__", "") != "make_inputs_require_grads"]
    if hooks or emb._forward_pre_hooks or hasattr(emb, "parametrizations"):
        return "the input embedding has hooks or parametrizations"
    if emb.max_norm is not None or emb.scale_grad_by_freq or emb.sparse:
        return "the input embedding uses max_norm, scale_grad_by_freq or sparse gradients"
    if type(w) is not nn.Parameter or not w.is_leaf or not w.is_contiguous():
        return f"the shared weight is a {type(w).__name__} (not a contiguous plain Parameter)"
    return None


_tie_logged = set()


def _tied_link(model, call):
    """A TiedGradient for this labels call where its embedding lookup goes
    through tied_embedding (``call``'s input_ids replaced by the looked-up
    inputs_embeds), else None (the first refusal of each reason logged)."""
    ids = call.get("input_ids")
    emb = model.get_input_embeddings()
    why = "the call gives no input_ids tensor" if not isinstance(ids, torch.Tensor) else _tie_refusal(model, emb)
    if why is None and not model.lm_head.weight.requires_grad:
        why = "the shared weight does not require grad"
    if why is not None:
        if why not in _tie_logged:
            _tie_logged.add(why)
            _log.info("seqfuse fused loss: transformers' own embedding lookup (its gradient added to the head's "
                      "by autograd): %s", why)
        return None
    link = TiedGradient(emb.weight)
    call["inputs_embeds"] = tied_embedding(call.pop("input_ids"), emb.weight, link, padding_idx=emb.padding_idx)
    return link


def fused_causal_lm_loss(model, hidden, labels, num_items_in_batch=None, ignore_index=-100, shift_labels=None,
                         tied=None):
    """transformers' ForCausalLMLoss of ``model.lm_head(hidden)`` against
    ``labels``, without the logits (linear_cross_entropy in chunks;
    ``tied``: the TiedGradient of the call's tied embedding lookup)."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    target = shift_labels.reshape(-1).to(device=hidden.device, dtype=torch.int64)
    flat = hidden.reshape(-1, hidden.shape[-1])
    if target.shape[0] != flat.shape[0]:
        raise ValueError(f"seqfuse fused loss: labels give {target.shape[0]} targets for {flat.shape[0]} hidden "
                         "states; labels must have input_ids' shape")
    head = model.lm_head
    reduction = "mean" if num_items_in_batch is None else "sum"
    loss = linear_cross_entropy(flat, head.weight, target, bias=head.bias, ignore_index=ignore_index,
                                reduction=reduction, fp8_recipe=model.__dict__.get(_FP8_HEAD), tied_embedding=tied)
    if num_items_in_batch is not None:
        if isinstance(num_items_in_batch, torch.Tensor):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss


def _labels_forward(inner):
    """The forward that sends labels calls to the fused loss (a module-level
    maker for seqfuse.hf.method_wrap, so copies of the model keep it)."""

    def forward(self, *args, **kwargs):
        sig, var_kw = forward_signature(type(self))
        call = dict(sig.bind_partial(self, *args, **kwargs).arguments)
        call.pop("self", None)
        call.update(call.pop(var_kw, {}))
        labels = call.pop("labels", None)
        keep = call.pop("logits_to_keep", 0)
        if labels is None:
            return inner(self, *args, **kwargs)
        if not (self.training and torch.is_grad_enabled()):
            # evaluation wants the logits (metrics, generation): transformers' own head and loss
            return inner(self, *args, **kwargs)
        if not (isinstance(keep, int) and keep == 0):
            _log.info("seqfuse fused loss: logits_to_keep=%r with labels runs transformers' own head and loss", keep)
            return inner(self, *args, **kwargs)
        return_dict = call.pop("return_dict", None)
        loss_kw = {k: call.pop(k) for k in ("ignore_index", "shift_labels") if k in call}
        link = None
        if call.get("inputs_embeds") is None:  # (else the caller looked the tokens up: transformers' lookup)
            call.pop("inputs_embeds", None)
            link = _tied_link(self, call)
        outputs = self.model(**call)  # num_items_in_batch and the rest go on, as transformers passes them
        loss = fused_causal_lm_loss(self, outputs.last_hidden_state, labels,
                                    num_items_in_batch=call.get("num_items_in_batch"), tied=link, **loss_kw)
        from transformers.modeling_outputs import CausalLMOutputWithPast

        cache_field = _output_cache_field(CausalLMOutputWithPast)
        result = CausalLMOutputWithPast(loss=loss, logits=None, hidden_states=outputs.hidden_states,
                                        attentions=outputs.attentions,
                                        **{cache_field: getattr(outputs, cache_field, None)})
        if return_dict is False:  # keep the logits' place in the tuple (to_tuple drops None fields)
            return (loss, None) + result.to_tuple()[1:]
        return result

    return forward


def wrap_causal_lm_loss(model):
    """Wrap ``model.forward`` so labels calls use the fused loss; returns the
    report's line (what the loss path is, or why it is transformers' own)."""
    why = _refusal(model)
    if why is not None:
        _log.info("seqfuse.hf.accelerate: labels keep %s: %s", OWN, why)
        return f"{OWN} ({why})"
    sig = inspect.signature(type(model).forward)
    if "labels" not in sig.parameters or not any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
        why = "its forward takes no labels / **kwargs"
        return f"{OWN} ({why})"
    wrap_method_once(model, "forward", _labels_forward)  # a second accelerate() keeps the one wrapper
    fp8 = ("; its GEMMs in FP8: the weight and hidden states scaled from their own amax, the logits' gradient "
           "from its bound") if model.__dict__.get(_FP8_HEAD) is not None else ""
    why = _tie_refusal(model, model.get_input_embeddings())
    if why is None:
        tie = ("; the tied input embedding's gradient added into the head's in its backward (tied_embedding; each "
               "call checks the rules again)")
    else:
        tie = "" if why == _NOT_TIED else f"; the tied input embedding looked up by transformers ({why})"
    return ("seqfuse linear_cross_entropy over lm_head in token chunks when training with labels (no full "
            f"logits; logits=None in the output{fp8}{tie}); eval and no-grad calls keep transformers' head and loss")
