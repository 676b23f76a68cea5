"""Key/value-cached generation for seqfuse's decoder models (the Llama and
Mixtral families).

``InferenceParams`` is the key/value cache, with Transformer Engine's name and
constructor arguments (max_batch_size, max_sequence_length, num_heads_kv,
head_dim_k, dtype): per layer a key and a value buffer [max_batch_size,
max_sequence_length, num_heads_kv, head_dim] (``key_value_memory_dict``,
allocated on first use), and each row's cached length
(``sequence_lengths``, int32 on the device).  Paged caches and the other
qkv formats of TE raise NotImplementedError.

``generate`` runs a prompt batch and then one token per step:
- prefill: the prompt batch, padded (right-padded input_ids with
  attention_mask) or packed (input_ids [t] with cu_seqlens), through every
  layer's own fused modules (RMSNorm + QKV GEMM, RoPE, fused attention,
  output projection, RMSNorm + SwiGLU MLP), keys and values (after RoPE)
  written into the cache at each sequence's positions;
- decode: the newest token of each row, rotated at its own position
  (RoPE's start_positions), attending over the row's cached keys (the
  kernel's padded layout with per-row key lengths), its key and value
  appended.
Greedy (``do_sample=False``) or sampling with temperature, top_k and top_p.
This is the same arithmetic as the layers' forward, step by step; the tests
check the cached logits against the full forward and the tokens against
transformers' generate.

Decode as a CUDA graph.  At batch 1 a decode step is a few hundred small
kernels, and launching them from Python costs far more than the GPU's work
(reading the weights once: about 0.6 ms for a 1B model in bf16 on an
H200).  So the step (``decode_step``) is written to be captured: the new
tokens come from a device buffer, each row's position is its cached length
on the device (RoPE's start_positions, the cache write's index, the
attention's cu_seqlens_kv, all computed on the device), the attention reads
the whole cache buffer with the per-row key lengths bounding each row (a
fixed kernel argument: the kernel walks only a row's own key tiles), the
lengths advance on the device, and nothing is read on the host (the cu_seqlens
value check is skipped under capture with its own log line, and made in
the uncaptured warm-up step instead).  In the captured step Mixtral's
experts run in their capture-safe form (every expert on every token, weight
0 where not routed: fixed grouped-GEMM row counts, no tokens-per-expert
read); an eager step runs the routed block.  The decode call
(bshd, one query per row, "padding" mask, no gradient) runs seqfuse's own
attention kernel in the automatic backend choice (the flash route leaves
forward-only calls to it; the cuDNN route takes no padding mask); the
torch routes' padded layouts are capture-safe too.

``DecodeGraph`` captures the step once per (cache, batch size), after one
uncaptured warm-up step on the capture stream; each later step copies the
new tokens in, replays, and samples from the graph's logits buffer
(sampling stays outside the graph).  generate keeps its cache per batch
size on the model (``release_decode_graphs`` frees them), so the next call
of that batch size replays the same graph; a caller's InferenceParams keeps
its own graphs.  A graph reads the parameters' memory: in-place updates are
seen, moved or re-allocated weights (``weights_signature``) are captured
again.  Not graphed, with a log line naming why: FP8 autocast (the
scaling state moves between steps; issue 20's cached FP8 weights are not
captured here), quantized parameters, an MoE block without a capture-safe
form.  With graphs off the same ``decode_step`` runs eagerly, so both give
the same tokens.

TransformerLayer itself does not take ``inference_params`` yet (it raises);
the cached path lives here, reading the layer's submodules, until the
modules grow one.
"""
import logging

import torch

from .. import ops
from ..ops import device_checks
from ..ops.args import as_float, exact_int
from ..modules.rope import apply_rotary_pos_emb
from ..quantization import is_fp8_enabled


class InferenceParams:
    """A key/value cache (TE's name and constructor arguments); see the module note."""

    def __init__(self, max_batch_size, max_sequence_length, num_heads_kv=None, head_dim_k=None, dtype=None,
                 head_dim_v=None, is_paged=False, total_num_pages=None, page_size=None, max_ctx_len=None,
                 qkv_format="bshd", custom_cache_manager=None, device=None):
        for name, value in (("max_batch_size", max_batch_size), ("max_sequence_length", max_sequence_length),
                            ("num_heads_kv", num_heads_kv), ("head_dim_k", head_dim_k)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"InferenceParams: {name} must be a positive int, got {value!r}")
        if head_dim_v is not None and head_dim_v != head_dim_k:
            raise NotImplementedError(f"InferenceParams: head_dim_v ({head_dim_v}) other than head_dim_k "
                                      f"({head_dim_k}) is not supported")
        if is_paged or total_num_pages is not None or page_size is not None or custom_cache_manager is not None:
            raise NotImplementedError("InferenceParams: paged caches (is_paged, total_num_pages, page_size, "
                                      "custom_cache_manager) are not supported")
        if qkv_format != "bshd":
            raise NotImplementedError(f"InferenceParams: qkv_format {qkv_format!r} is not supported (bshd only)")
        if dtype is None or not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"InferenceParams: dtype must be a floating torch.dtype, got {dtype!r}")
        self.max_batch_size = max_batch_size
        self.max_sequence_length = max_sequence_length
        self.max_ctx_len = max_ctx_len
        self.num_heads_kv = num_heads_kv
        self.head_dim_k = head_dim_k
        self.dtype = dtype
        self.device = torch.device(device) if device is not None else torch.get_default_device()
        self.key_value_memory_dict = {}
        self.batch_size = 0
        self.sequence_lengths = torch.zeros(max_batch_size, dtype=torch.int32, device=self.device)
        # generate's CUDA graphs of the decode step over these buffers, one per batch size (DecodeGraph)
        self.decode_graphs = {}
        self.graph_captures = 0

    def allocate_memory(self, layer_number):
        """The (key, value) buffers of ``layer_number``, allocated on first use."""
        if layer_number not in self.key_value_memory_dict:
            shape = (self.max_batch_size, self.max_sequence_length, self.num_heads_kv, self.head_dim_k)
            self.key_value_memory_dict[layer_number] = (
                torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device))
        return self.key_value_memory_dict[layer_number]

    def reset(self):
        """Forget every cached token (the buffers are kept)."""
        self.sequence_lengths.zero_()
        self.batch_size = 0

    @property
    def sequence_len_offset(self):
        """TE's name: the longest cached length (one host read)."""
        return int(self.sequence_lengths[:self.batch_size].max()) if self.batch_size else 0


def _split_qkv(mixed, num_heads, num_groups, head_dim):
    """q [..., heads, d], k and v [..., groups, d] of a fused projection in TE's
    interleaved per-group row order (seqfuse.hf.qkv's layout)."""
    per = num_heads // num_groups
    grouped = mixed.view(*mixed.shape[:-1], num_groups, per + 2, head_dim)
    q, k, v = torch.split(grouped, [per, 1, 1], dim=-2)
    return q.reshape(*mixed.shape[:-1], num_heads, head_dim), k.squeeze(-2), v.squeeze(-2)


def _cu(lengths):
    return torch.nn.functional.pad(torch.cumsum(lengths, 0, dtype=torch.int32), (1, 0))


def cached_layer_step(layer, x, freqs, cache, layer_number, rows, positions, pick, attn, rope):
    """One decoder layer (a TransformerLayer, or a layer with its
    ``self_attention`` and a ``feed_forward(x)`` method) on ``x`` with its
    keys and values (after RoPE) written into ``cache`` at (rows,
    positions): those of the tokens
    ``k[pick]`` (``pick`` None: every token of a packed call), and attention
    as ``attn`` says: ("self", kwargs) over the call's own tokens (prefill),
    or ("cache", kwargs) over the first ``len(x)`` rows of the cache, at
    their full length (decode: the per-row key lengths come from
    kwargs' cu_seqlens_kv, a device tensor, so the call's arguments are the
    same at every step and it can be captured in a CUDA graph).  ``rope``:
    keyword arguments of apply_rotary_pos_emb (format, cu_seqlens,
    start_positions).  A decode step being captured into a CUDA graph asks
    the feed-forward block for its capture-safe form (``feed_forward(x,
    capture_safe=True)``: the Mixtral family's experts without a host read,
    every expert on every token); run eagerly it takes the routed block."""
    sa = layer.self_attention
    if not (sa.fuse_qkv_params and sa.qkv_weight_interleaved and sa.input_layernorm):
        raise NotImplementedError("cached generation needs fused, interleaved QKV parameters behind the input norm")
    mixed = sa.layernorm_qkv(x)
    q, k, v = _split_qkv(mixed, sa.num_attention_heads, sa.num_gqa_groups, sa.kv_channels)
    q = apply_rotary_pos_emb(q, freqs, **rope)
    k = apply_rotary_pos_emb(k, freqs, **rope)
    k_cache, v_cache = cache.allocate_memory(layer_number)
    k_cache[rows, positions] = (k if pick is None else k[pick]).to(k_cache.dtype)
    v_cache[rows, positions] = (v if pick is None else v[pick]).to(v_cache.dtype)
    kind, kw = attn
    if kind == "self":
        out = ops.attention(q, k, v, **kw)
    else:
        b = q.shape[0]
        out = ops.attention(q, k_cache[:b], v_cache[:b], **kw)
    x = x + sa.proj(out.reshape(*out.shape[:-2], -1))
    # a layer whose feed-forward block is not TransformerLayer's LayerNormMLP
    # (the Mixtral family's mixture of experts) says how to run it
    feed_forward = getattr(layer, "feed_forward", None)
    if feed_forward is None:
        return x + layer.layernorm_mlp(x)
    if kind == "cache" and device_checks.capturing(x):
        return feed_forward(x, capture_safe=True)  # being captured: no host read (every expert runs)
    return feed_forward(x)  # eager: the routed block, its experts' work only


def decode_step(model, cache, tokens, freqs, rows, cu_q):
    """One decode step of every row of ``tokens`` ([b] int64, the newest
    token of each row): each token at position = its row's cached length
    (``cache.sequence_lengths[:b]``, on the device), its key and value
    appended, attention over the row's cached keys; the lengths advanced
    by one (on the device).  Returns the next-token logits [b, vocab].

    Every value that changes from step to step is read from a device
    tensor (the tokens, the lengths) and every kernel argument is fixed
    (the cache's full length as the keys' extent, the row lengths as
    cu_seqlens_kv, RoPE's start positions as a tensor): no host read, no
    allocation whose size varies.  So the same function runs eagerly or
    under CUDA graph capture (DecodeGraph) and both give the same numbers.
    ``freqs``: RoPE angles covering the cache's length; ``rows``: arange(b);
    ``cu_q``: arange(b + 1) int32 (one query per row)."""
    inner = model.model
    b = tokens.shape[0]
    lens = cache.sequence_lengths[:b]
    start = lens.clone()
    pos = start.long()
    dec_kw = dict(qkv_format="bshd", attn_mask_type="padding", cu_seqlens_q=cu_q, cu_seqlens_kv=_cu(start + 1),
                  max_seqlen_q=1, max_seqlen_kv=cache.max_sequence_length)
    rope = dict(tensor_format="bshd", start_positions=start)
    x = inner.embed_tokens(tokens)[:, None, :]
    for i, layer in enumerate(inner.layers):
        # (slice(None), 0): each row's one new key, a view (no gather kernel)
        x = cached_layer_step(layer, x, freqs, cache, i + 1, rows, pos, (slice(None), 0), ("cache", dec_kw), rope)
    h = inner.norm(x)[:, 0]
    logits = torch.nn.functional.linear(h, model.lm_head.weight.to(h.dtype))
    lens.add_(1)
    return logits


def _positive_int(name, value):
    """``value`` as a Python int >= 1 (an integer of any kind: numpy's, a
    one-element integer tensor), or a TypeError / ValueError naming it."""
    n = exact_int(value)
    if n is None:
        raise TypeError(f"generate: {name} must be an int, got {value!r}")
    if n < 1:
        raise ValueError(f"generate: {name} must be >= 1, got {n}")
    return n


def _check_sampling(do_sample, temperature, top_k, top_p, max_new_tokens):
    """The sampling arguments checked; returns (max_new_tokens, temperature,
    top_k, top_p), the numbers as Python ints and floats where generation
    reads them (top_k and top_p None stay None; temperature, top_k and top_p
    as given when not sampling)."""
    max_new_tokens = _positive_int("max_new_tokens", max_new_tokens)
    if do_sample not in (True, False):  # (a truthy string such as "no" would otherwise sample)
        raise TypeError(f"generate: do_sample must be True or False, got {do_sample!r}")
    if do_sample:
        temperature = as_float("generate", "temperature", temperature, above=0)
        if top_k is not None:
            top_k = _positive_int("top_k", top_k)
        if top_p is not None:
            top_p = as_float("generate", "top_p", top_p, above=0, maximum=1)
    return max_new_tokens, temperature, top_k, top_p


def _token_ids(value, name, vocab):
    """The ids of ``value`` (one int, a list or tuple of ints, or an integer
    tensor of at most one dimension) as a list, each in [0, vocab)."""
    if isinstance(value, torch.Tensor):
        if value.dim() > 1 or value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
            raise TypeError(f"generate: {name} must be an int, a list of ints or a 0-/1-D integer tensor, got a "
                            f"{value.dtype} tensor of shape {tuple(value.shape)}")
        ids = value.reshape(-1).tolist()
    elif isinstance(value, (list, tuple)):
        ids = list(value)
    else:
        ids = [value]
    ids = [exact_int(i) for i in ids]
    for i in ids:
        if i is None:
            raise TypeError(f"generate: {name} must be an int or a list of ints, got {value!r}")
        if not 0 <= i < vocab:
            raise ValueError(f"generate: {name} must be token ids in [0, vocab_size={vocab}), got {value!r} "
                             "(an id outside the vocabulary is never generated, so it would never stop a row)")
    return ids


def _check_cache(cache, cfg, dtype, device):
    """A caller's InferenceParams must match the model's keys and values."""
    if not isinstance(cache, InferenceParams):
        raise TypeError(f"generate: inference_params must be an InferenceParams or None, got {type(cache).__name__}")
    if cache.num_heads_kv != cfg.num_key_value_heads or cache.head_dim_k != cfg.head_dim:
        raise ValueError(f"generate: inference_params holds {cache.num_heads_kv} key/value heads of dim "
                         f"{cache.head_dim_k}; the model has {cfg.num_key_value_heads} of dim {cfg.head_dim} "
                         "(num_heads_kv and head_dim_k must match the config)")
    if cache.dtype != dtype:
        raise ValueError(f"generate: inference_params' dtype {cache.dtype} must be the model's {dtype}")
    if cache.sequence_lengths.device != device:
        raise ValueError(f"generate: inference_params is on {cache.sequence_lengths.device}, input_ids on {device} "
                         "(they must be on one device)")


def next_tokens(logits, do_sample, temperature=1.0, top_k=None, top_p=None, generator=None):
    """[b] token ids from last-position logits [b, V]: argmax, or a draw
    after temperature, top-k and top-p (nucleus) filtering, as transformers'
    logits warpers define them (top-k first, then top-p keeping at least one)."""
    if not do_sample:
        return logits.argmax(-1)
    scores = logits.float() / temperature
    if top_k is not None and top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=False, dim=-1)
        cum = sorted_scores.softmax(-1).cumsum(-1)
        drop_sorted = cum <= (1 - top_p)
        drop_sorted[..., -1:] = False  # keep the most likely token
        scores = scores.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
    return torch.multinomial(scores.softmax(-1), 1, generator=generator).squeeze(-1)


# ------------------------------------------------------------ CUDA graphs of the decode step
_log = logging.getLogger("seqfuse")
_logged = set()
#: one side stream per CUDA device for warm-up and capture (torch's advice: warm up on the stream that
#: captures, so lazily made state, e.g. a GEMM workspace cached per stream, exists before capture)
_capture_streams = {}
#: model caches made by generate are rounded up to this many positions, so that calls of slightly
#: different prompt lengths or token counts reuse one cache and its graphs
CACHE_LENGTH_STEP = 256


def _log_once(level, message):
    if message not in _logged:
        _logged.add(message)
        _log.log(level, message)


def weights_signature(model):
    """Where and how the model's parameters and buffers are stored (address,
    dtype, device of each): a captured graph reads exactly those addresses,
    so a graph is valid only while this is unchanged.  A dtype or device
    move, or loading weights into new tensors, changes it; an in-place
    update (an optimizer step, load_state_dict's copy) does not, and a
    replay reads the new values."""
    return tuple((t.data_ptr(), t.dtype, t.device) for t in (*model.parameters(), *model.buffers()))


class DecodeGraph:
    """The decode step (``decode_step``) of batch size ``b`` over ``cache``,
    captured once as a CUDA graph: a static token buffer [b] in, the logits
    buffer [b, vocab] out; the cache's buffers, its lengths
    (``sequence_lengths``, advanced by the step itself) and the RoPE angles
    are fixed addresses.  ``run(tokens)`` copies the tokens in and replays.
    Kept in ``cache.decode_graphs[b]``; ``replays`` counts the replays."""

    def __init__(self, model, cache, b, signature):
        dev = cache.device
        self.b, self.cache, self.signature = b, cache, signature
        self.tokens = torch.zeros(b, dtype=torch.long, device=dev)
        self.freqs = model.model.rotary_emb(cache.max_sequence_length)
        self.rows = torch.arange(b, device=dev)
        self.cu_q = torch.arange(b + 1, dtype=torch.int32, device=dev)
        self.replays = 0
        stream = _capture_stream(dev)

        def step():
            return decode_step(model, cache, self.tokens, self.freqs, self.rows, self.cu_q)

        lens = cache.sequence_lengths[:b]
        saved = lens.clone()
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            # warm-up: one real step (it writes the key/value slot that the first replay rewrites); the
            # lengths it advanced are put back
            step()
            lens.copy_(saved)
        torch.cuda.current_stream(dev).wait_stream(stream)
        # the decode attention's route, named once per kind of call (every route takes this call capture-safely:
        # seqfuse's kernel in auto, or the flash / float32 routes' device-side padded layouts)
        sa = model.model.layers[0].self_attention
        k_cache, v_cache = cache.allocate_memory(1)
        q = torch.empty(b, 1, sa.num_attention_heads, sa.kv_channels, dtype=k_cache.dtype, device=dev)
        route, why = ops.attention_backend(q, k_cache[:b], v_cache[:b], "bshd", "padding", cu_seqlens_q=self.cu_q,
                                           cu_seqlens_kv=self.cu_q)
        _log_once(logging.INFO, f"seqfuse generate: the decode step is captured as a CUDA graph; its attention "
                                f"({str(k_cache.dtype).replace('torch.', '')}, head dim {sa.kv_channels}) runs "
                                f"the {route} route: {why}")
        self.logits = self._capture(step, stream)

    def _capture(self, step, stream):
        """``step`` captured into ``self.graph`` on ``stream`` (nothing runs);
        returns the output buffer its replays write."""
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=stream):
            return step()

    def _replay(self):
        self.graph.replay()

    def run(self, tokens):
        """Logits [b, vocab] of the step after ``tokens`` [b] (the buffer is
        overwritten by the next run)."""
        self.tokens.copy_(tokens)
        self._replay()
        self.replays += 1
        return self.logits


def _capture_stream(device):
    """The side stream that warms up and captures decode graphs on ``device``."""
    stream = _capture_streams.get(device.index)
    if stream is None:
        stream = _capture_streams[device.index] = torch.cuda.Stream(device)
    return stream


def _graph_refusal(model, device, b):
    """Why the decode step of this call cannot be captured, or None."""
    if device.type != "cuda":
        return f"the model runs on {device.type}, not CUDA"
    if not hasattr(torch.cuda, "CUDAGraph"):
        return "this torch has no torch.cuda.CUDAGraph"
    if is_fp8_enabled():
        return ("FP8 autocast is on: its scaling state (amax history, scale update) changes between steps "
                "and is not captured here; the FP8 decode step runs eagerly")
    for name, p in model.named_parameters():
        if type(p.data) is not torch.Tensor:
            return f"parameter {name} is a {type(p.data).__name__} (quantized weights are not captured)"
    for layer in model.model.layers:
        mlp = getattr(layer, "mlp", None)
        if getattr(layer, "feed_forward", None) is not None and not hasattr(mlp, "forward_every_expert"):
            return (f"layer {type(layer).__name__}'s feed-forward block {type(mlp).__name__} has no capture-safe "
                    "form (forward_every_expert)")
    return None


def _model_cache(model, b, total, dtype, device):
    """generate's own cache for batch size ``b`` when graphs are on: kept on
    the model (one per batch size, with its graphs) and reused while it is
    long enough and of the weights' dtype and device; its length is
    ``total`` rounded up to CACHE_LENGTH_STEP."""
    caches = model.__dict__.setdefault("_seqfuse_decode_caches", {})
    cache = caches.get(b)
    if cache is not None and cache.max_sequence_length >= total and cache.dtype == dtype and \
            cache.device == device:
        return cache
    if cache is not None:
        _log.info("seqfuse generate: batch %d needs a new key/value cache (%d positions, %s on %s; the kept one: "
                  "%d, %s on %s): its decode graph is captured again", b, total, dtype, device,
                  cache.max_sequence_length, cache.dtype, cache.device)
    length = -(-total // CACHE_LENGTH_STEP) * CACHE_LENGTH_STEP
    cfg = model.config
    caches[b] = InferenceParams(b, length, cfg.num_key_value_heads, cfg.head_dim, dtype=dtype, device=device)
    return caches[b]


def release_decode_graphs(model):
    """Forget the key/value caches and decode graphs that generate kept on
    ``model`` (their GPU memory is freed when nothing else holds them)."""
    model.__dict__.pop("_seqfuse_decode_caches", None)


def decode_graph_stats(model):
    """{batch size: (captures, replays)} of the decode graphs of the caches
    generate kept on ``model`` (caches passed as inference_params keep their
    own: ``cache.decode_graphs``)."""
    caches = model.__dict__.get("_seqfuse_decode_caches", {})
    return {b: (c.graph_captures, sum(g.replays for g in c.decode_graphs.values())) for b, c in caches.items()}


def _decode_runner(model, cache, b, freqs, use_graphs, device):
    """A function tokens [b] -> logits [b, vocab] of the next decode step:
    the cache's captured graph (captured now when missing or stale) when
    ``use_graphs``, else decode_step run eagerly."""
    if use_graphs:
        signature = weights_signature(model)
        graph = cache.decode_graphs.get(b)
        if graph is not None and graph.signature != signature:
            _log.info("seqfuse generate: the model's weights moved (dtype, device or storage) since batch %d's "
                      "decode graph was captured: capturing it again", b)
            graph = None
        if graph is None:
            cache.decode_graphs.pop(b, None)
            graph = cache.decode_graphs[b] = DecodeGraph(model, cache, b, signature)
            cache.graph_captures += 1
        return graph.run
    rows = torch.arange(b, device=device)
    cu_q = torch.arange(b + 1, dtype=torch.int32, device=device)
    return lambda tokens: decode_step(model, cache, tokens, freqs, rows, cu_q)


@torch.no_grad()
def generate(model, input_ids, attention_mask=None, cu_seqlens=None, max_new_tokens=32, do_sample=False,
             temperature=1.0, top_k=None, top_p=None, eos_token_id=None, pad_token_id=None, generator=None,
             inference_params=None, decode_graphs=None):
    """Tokens generated by ``model`` (a SeqfuseLlamaForCausalLM or
    SeqfuseMixtralForCausalLM) after each prompt.

    Prompts: padded ``input_ids`` [b, s] with ``attention_mask`` (right
    padding only: each row's tokens first), or packed ``input_ids`` [t] /
    [1, t] with ``cu_seqlens``.  Returns int64 [b, max_new_tokens]: row i
    holds the new tokens of prompt i; after ``eos_token_id`` (default: the
    config's; one id or a list) a row holds ``pad_token_id`` (default: the
    config's pad, else the eos).  ``inference_params``: an InferenceParams to
    use (reset first), else one is made for this call (with decode graphs:
    kept on the model for the next call of this batch size).

    ``decode_graphs``: replay the decode step as a CUDA graph (DecodeGraph),
    captured once per batch size and cache and replayed by later calls.
    None (default): on for CUDA models where the step can be captured;
    where it cannot (FP8 autocast, quantized weights, an MoE block without a
    capture-safe form) the decode runs eagerly and logger "seqfuse" says
    why (once per reason).  True: the same, except a CPU model is a
    ValueError.  False: eager.  Both give the same tokens: the eager step is
    the function the graph captures."""
    max_new_tokens, temperature, top_k, top_p = _check_sampling(do_sample, temperature, top_k, top_p, max_new_tokens)
    if decode_graphs not in (None, True, False):
        raise ValueError(f"generate: decode_graphs must be None (auto), True or False, got {decode_graphs!r}")
    cfg = model.config
    inner = model.model
    layout = inner.layout(input_ids, attention_mask, None, cu_seqlens, None)
    device = input_ids.device
    if decode_graphs and device.type != "cuda":
        raise ValueError(f"generate: decode_graphs=True needs a CUDA model and input_ids, got {device.type} "
                         "(CUDA graphs)")
    weights = inner.embed_tokens.weight
    if weights.device != device:  # (torch's own error names neither)
        raise ValueError(f"generate: input_ids are on {device}, the model on {weights.device} (move the "
                         f"prompts with input_ids.to({str(weights.device)!r}))")
    vocab = weights.shape[0]
    if input_ids.numel():
        lo, hi = torch.stack(torch.aminmax(input_ids)).tolist()  # (one host read)
        if not 0 <= lo <= hi < vocab:  # (an out-of-range id is an IndexError on the CPU, a device assert on CUDA)
            raise ValueError(f"generate: input_ids must be token ids in [0, vocab_size={vocab}), got values in "
                             f"[{lo}, {hi}]")
    eos = cfg.eos_token_id if eos_token_id is None else eos_token_id
    eos = torch.tensor([] if eos is None else _token_ids(
        eos, "eos_token_id" if eos_token_id is not None else "eos_token_id (the config's)", vocab),
        device=device, dtype=torch.long)
    if pad_token_id is not None:
        pad_token_id, given = exact_int(pad_token_id), pad_token_id
        if pad_token_id is None:
            raise TypeError(f"generate: pad_token_id must be an int or None, got {given!r}")
    pad = pad_token_id if pad_token_id is not None else (cfg.pad_token_id if cfg.pad_token_id is not None
                                                         else (int(eos[0]) if eos.numel() else 0))
    if layout.packed:
        cu = layout.cu_seqlens.to(device)
        lengths = (cu[1:] - cu[:-1]).to(torch.int32)
        ids = input_ids.reshape(-1)
        bounds = layout.cu_seqlens.tolist()  # (read where the caller's tensor is, before the copy to the device)
        if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != ids.numel() or \
                any(a >= z for a, z in zip(bounds, bounds[1:])):
            raise ValueError(f"generate: cu_seqlens must start at 0, rise strictly (no empty prompt) and end at the "
                             f"number of tokens ({ids.numel()}), got {bounds}")
        rows = torch.repeat_interleave(torch.arange(lengths.numel(), device=device), lengths.long())
        positions = torch.arange(ids.numel(), device=device) - cu[:-1].long()[rows]
        rope = dict(tensor_format="thd", cu_seqlens=cu)
        self_kw = dict(qkv_format="thd", attn_mask_type="padding_causal", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                       max_seqlen_q=layout.rope_len, max_seqlen_kv=layout.rope_len)
        x = inner.embed_tokens(ids)
        last, pick = cu[1:].long() - 1, None
    else:
        b, s = input_ids.shape
        if b == 0:
            raise ValueError(f"generate: input_ids must hold at least one prompt, got shape {tuple(input_ids.shape)}")
        mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        lengths = mask.sum(-1).to(torch.int32)
        cols = torch.arange(s, device=device)
        if not torch.equal(mask, cols < lengths[:, None]) or bool((lengths == 0).any()):
            raise NotImplementedError("generate: padded prompts must be right-padded (each row's tokens first) "
                                      "and not empty")
        rows, positions = mask.nonzero(as_tuple=True)
        cu = _cu(lengths)
        rope = dict(tensor_format="bshd")
        self_kw = dict(qkv_format="bshd", attn_mask_type="padding_causal", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                       max_seqlen_q=s, max_seqlen_kv=s)
        x = inner.embed_tokens(input_ids)
        last, pick = None, (rows, positions)
    b = lengths.numel()
    total = int(lengths.max()) + max_new_tokens
    use_graphs = decode_graphs is not False and max_new_tokens > 1
    if use_graphs:
        why = _graph_refusal(model, device, b)
        if why is not None:
            use_graphs = False
            if device.type == "cuda":  # (on the CPU eager is the only way, not a fallback)
                _log_once(logging.WARNING if decode_graphs else logging.INFO,
                          f"seqfuse generate: the decode step runs eagerly, not as a CUDA graph: {why}")
    dtype = inner.embed_tokens.weight.dtype
    if inference_params is None:
        if use_graphs:
            inference_params = _model_cache(model, b, total, dtype, device)
        else:
            inference_params = InferenceParams(b, total, cfg.num_key_value_heads, cfg.head_dim, dtype=dtype,
                                               device=device)
    else:
        _check_cache(inference_params, cfg, dtype, device)
    if inference_params.max_batch_size < b or inference_params.max_sequence_length < total:
        raise ValueError(f"generate: inference_params holds {inference_params.max_batch_size} rows of "
                         f"{inference_params.max_sequence_length} tokens; this call needs {b} of {total}")
    cache = inference_params
    cache.reset()
    cache.batch_size = b
    freqs = inner.rotary_emb(cache.max_sequence_length)

    # prefill
    for i, layer in enumerate(inner.layers):
        x = cached_layer_step(layer, x, freqs, cache, i + 1, rows, positions, pick, ("self", self_kw), rope)
    x = inner.norm(x)
    h_last = x[last] if layout.packed else x[torch.arange(b, device=device), lengths.long() - 1]
    cache.sequence_lengths[:b] = lengths

    out = torch.full((b, max_new_tokens), pad, dtype=torch.long, device=device)
    done = torch.zeros(b, dtype=torch.bool, device=device)
    logits = torch.nn.functional.linear(h_last, model.lm_head.weight.to(h_last.dtype))
    step_fn = _decode_runner(model, cache, b, freqs, use_graphs, device) if max_new_tokens > 1 else None
    for step in range(max_new_tokens):
        tok = next_tokens(logits, do_sample, temperature, top_k, top_p, generator)
        tok = torch.where(done, torch.full_like(tok, pad), tok)
        out[:, step] = tok
        done |= torch.isin(tok, eos)
        if step + 1 == max_new_tokens:
            break
        logits = step_fn(tok)
    return out


class CachedGenerate:
    """``generate`` (this module's) for the seqfuse causal-LM families
    (Llama, Mixtral), a base class placed before their PreTrainedModel base
    (transformers' own generate() runs on the exported model).  Its name
    must not end in "GenerationMixin": transformers' can_generate() looks
    for that text in a class's bases, and these models do not implement
    GenerationMixin's interface (generation_config and the rest)."""

    def generate(self, input_ids, attention_mask=None, cu_seqlens=None, max_new_tokens=32, **kwargs):
        """New tokens after each prompt, with a key/value cache: greedy, or
        sampling (do_sample, temperature, top_k, top_p, generator); the
        decode step replayed as a CUDA graph on CUDA (``decode_graphs``);
        see seqfuse.hf.generation.generate.  Returns int64 [batch,
        max_new_tokens]."""
        return generate(self, input_ids, attention_mask=attention_mask, cu_seqlens=cu_seqlens,
                        max_new_tokens=max_new_tokens, **kwargs)

    def release_decode_graphs(self):
        """Forget the key/value caches and decode graphs generate kept on
        this model (seqfuse.hf.generation.release_decode_graphs)."""
        release_decode_graphs(self)
