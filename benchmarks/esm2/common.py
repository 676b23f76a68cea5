"""Shared pieces of the ESM-2 benchmarks (bench_esm2.py, bench_esm2_convergence.py):
paths, the real UniProt batches, model construction with identical weights
for Hugging Face and seqfuse, and the FLOP count.

Batches come from seqfuse.data on the recipe's real data
(recipes/esm2/data/full when prepared, else the committed subset), cropped
to max length 1024 like the recipe.  ``fixed_length=True`` instead cuts the
concatenated proteins into windows of exactly max_length - 2 residues, so
every sequence has max_length tokens and no layout pads anything.

Same samples in every layout: ``real_length_layouts`` takes the recipe's
packed batches as the definition of which (masked) samples a run trains on,
and re-batches exactly those samples padded, either grouped by length
(``padded``: shuffled pools sorted by length, cut by the token budget and
padded to each batch's longest, as transformers' Trainer does with
group_by_length) or in the packed batches' random order (``unsorted``: what
a padded loader without length grouping gives).
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.dirname(HERE)
ROOT = os.path.dirname(BENCH)
sys.path.insert(0, BENCH)  # harness
sys.path.insert(0, os.path.join(ROOT, "recipes", "esm2"))  # esm2_recipe (FLOPs, shared with the recipe)
try:
    import seqfuse  # noqa: F401
except ImportError:  # a source checkout built in place
    sys.path.insert(0, os.path.join(ROOT, "python"))

import torch  # noqa: E402

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256)  # CPU smoke runs


def data_dir(path=None):
    if path:
        return path
    full = os.path.join(ROOT, "recipes", "esm2", "data", "full")
    if os.path.isfile(os.path.join(full, "train.parquet")):
        return full
    sub = os.path.join(ROOT, "recipes", "esm2", "data", "subset")
    print(f"[esm2 bench] recipes/esm2/data/full is not prepared here: using the committed subset {sub} "
          "(same source and length distribution, 2,000 proteins)")
    return sub


def load_train_sequences(path):
    from seqfuse.data import load_sequences

    _, seqs = load_sequences(os.path.join(path, "train.parquet"))
    return seqs


def fixed_length_sequences(seqs, residues):
    """Windows of exactly ``residues`` residues cut from the concatenated proteins."""
    cat = "".join(seqs)
    return [cat[i:i + residues] for i in range(0, len(cat) - residues + 1, residues)]


def make_batches(seqs, n, *, tokens, max_length=1024, packed=True, pad_to_multiple_of=16, seed=0, rank=0,
                 world_size=1, balance_ranks=False, pin=False):
    """The first ``n`` batches (cycling epochs) of the recipe's MLM loader.
    ``pin``: in page-locked memory, as the recipe's CUDA loader gives them (a
    copy from pageable memory makes the host wait for the GPU to drain: a
    stall at the start of every step)."""
    from seqfuse.data import EsmTokenizer, TokenizedSequences, build_mlm_loader

    tok = EsmTokenizer()
    loader = build_mlm_loader(TokenizedSequences(seqs, tok), tok, max_tokens=tokens, max_length=max_length,
                              packed=packed, pad_to_multiple_of=pad_to_multiple_of, seed=seed, rank=rank,
                              world_size=world_size, balance_ranks=balance_ranks)
    out = []
    while len(out) < n:
        for b in loader:
            out.append(pin_batch(b) if pin else b)
            if len(out) == n:
                break
    return out


def packed_to_padded(batch, multiple=8):
    """The same samples (and masks) as a padded [B, L] batch, for Hugging Face."""
    cu = batch["cu_seqlens"].tolist()
    n = int(batch["num_sequences"])
    lens = [cu[i + 1] - cu[i] for i in range(n)]
    L = (max(lens) + multiple - 1) // multiple * multiple
    ids = torch.full((n, L), 1, dtype=torch.long)  # <pad> = 1
    labels = torch.full((n, L), -100, dtype=torch.long)
    mask = torch.zeros((n, L), dtype=torch.long)
    for i in range(n):
        a, b = cu[i], cu[i + 1]
        ids[i, : b - a] = batch["input_ids"][a:b]
        labels[i, : b - a] = batch["labels"][a:b]
        mask[i, : b - a] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask, "num_tokens": sum(lens)}


def seqfuse_config(size):
    from seqfuse.hf import SeqfuseEsmConfig, esm2_config

    return SeqfuseEsmConfig(**TINY) if size == "tiny" else esm2_config(size)


def build_hf(size, device, dtype, seed=0, attn="sdpa"):
    """transformers' EsmForMaskedLM of a published ESM-2 shape, seeded init."""
    from transformers import EsmForMaskedLM

    from seqfuse.hf import to_hf_config

    torch.manual_seed(seed)
    cfg = to_hf_config(seqfuse_config(size))
    with torch.device(device):
        model = EsmForMaskedLM._from_config(cfg, attn_implementation=attn, dtype=dtype)
    return model.to(device=device, dtype=dtype)


def build_seqfuse(size, device, dtype, seed=0):
    """SeqfuseEsmForMaskedLM with exactly the weights build_hf(size, seed) gets."""
    from seqfuse.hf.convert import from_hf_model

    hf = build_hf(size, device, dtype, seed=seed)
    model = from_hf_model(hf)
    del hf
    model.esm.contact_head.requires_grad_(False)
    return model


def forward_loss(model, batch, device):
    """The MLM loss of one batch.  A padded batch whose attention_mask is all
    ones (the fixed-length rows) goes in without a mask, for both models: it
    is checked here on the host copy, where a model handed a device mask has
    to read it back (a host sync per step) to learn that nothing is padded."""
    b = {k: (v.to(device, non_blocking=True) if torch.is_tensor(v) else v) for k, v in batch.items()}
    if "attention_mask" in batch and bool(batch["attention_mask"].all()):
        b["attention_mask"] = None
    if "cu_seqlens" in b:
        return model(input_ids=b["input_ids"], labels=b["labels"], cu_seqlens=b["cu_seqlens"],
                     max_seqlen=int(b["max_seqlen"])).loss
    return model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], labels=b["labels"]).loss


def seq_lengths(batch):
    if "cu_seqlens" in batch:
        cu = batch["cu_seqlens"].tolist()
        return [cu[i + 1] - cu[i] for i in range(int(batch["num_sequences"]))]
    return batch["attention_mask"].sum(-1).tolist()


#: The precision names of seqfuse's (and TE's) rows, each a recipe of fp8_recipe.
RECIPE_NAMES = ("bf16", "fp8_delayed", "fp8_current", "fp8_block")


def fp8_recipe(name):
    from seqfuse.common.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling

    recipes = dict(zip(RECIPE_NAMES, (None, DelayedScaling(), Float8CurrentScaling(), Float8BlockScaling())))
    return recipes[name]


#: transformers' LengthGroupedSampler sorts "mega-batches" of 50 batches' worth of samples.
GROUP_POOL_BATCHES = 50


def split_packed(batch):
    """The samples of a packed batch, as the collators take them (the dummy
    padding segment at the end is not a sample)."""
    cu = batch["cu_seqlens"].tolist()
    idx = batch.get("sample_indices")
    out = []
    for i in range(int(batch["num_sequences"])):
        a, b = cu[i], cu[i + 1]
        s = {"input_ids": batch["input_ids"][a:b].clone(), "labels": batch["labels"][a:b].clone()}
        if idx is not None:
            s["index"] = int(idx[i])
        out.append(s)
    return out


def padded_batches(samples, *, tokens, group_by_length, pool=None, pad_to_multiple_of=16, seed=0):
    """``samples`` re-batched padded [B, L] under the token budget B x L <= tokens.
    ``group_by_length``: shuffle, sort pools of ``pool`` samples by length,
    cut greedily, shuffle the batches (seqfuse's TokenBudgetBatchSampler with
    bucket_size=pool; pool None: all samples form one pool); else the samples'
    own order, cut greedily."""
    from seqfuse.data import EsmTokenizer, PaddedBSHDCollator, TokenBudgetBatchSampler

    if not samples:
        raise ValueError("padded_batches: no samples")
    lengths = [int(s["input_ids"].numel()) for s in samples]
    sampler = TokenBudgetBatchSampler(lengths, tokens, padded=True, pad_to_multiple_of=pad_to_multiple_of,
                                      shuffle=group_by_length,
                                      bucket_size=(pool or len(samples)) if group_by_length else None, seed=seed)
    collate = PaddedBSHDCollator(EsmTokenizer().pad_token_id, pad_to_multiple_of=pad_to_multiple_of)
    return [collate([samples[i] for i in b]) for b in sampler.batches(0)]


def real_length_layouts(seqs, n_timed, n_warm=0, *, tokens, max_length=1024, seed=0, pin=False, pool=None):
    """{layout: (warm-up batches, timed batches)} for "packed", "padded"
    (grouped by length) and "unsorted", all on the samples of the recipe's
    first ``n_warm + n_timed`` packed batches: the first ``n_warm`` packed
    batches' samples are the warm-up, the rest the timed ones, in every
    layout.  ``pool``: samples per length-sorted pool (default: 50 packed
    batches' worth, transformers' mega-batch of 50 batches)."""
    packed = make_batches(seqs, n_warm + n_timed, tokens=tokens, max_length=max_length, packed=True, seed=seed)
    warm, timed = packed[:n_warm], packed[n_warm:]
    out = {"packed": (warm, timed)}
    for layout, grouped in (("padded", True), ("unsorted", False)):
        parts = []
        for group in (warm, timed):
            samples = [s for b in group for s in split_packed(b)]
            if pool is None:
                per_batch = len(samples) / max(1, len(group))
                pool_n = max(1, int(round(GROUP_POOL_BATCHES * per_batch)))
            else:
                pool_n = pool
            parts.append(padded_batches(samples, tokens=tokens, group_by_length=grouped, pool=pool_n, seed=seed)
                         if samples else [])
        out[layout] = tuple(parts)
    if pin:
        out = {k: tuple([pin_batch(b) for b in part] for part in v) for k, v in out.items()}
    return out


def pin_batch(batch):
    return {k: v.pin_memory() if torch.is_tensor(v) else v for k, v in batch.items()}


def batch_shape(batch):
    """The shape the model sees: [B, L] padded, [T] packed."""
    return tuple(batch["input_ids"].shape)
