"""Shared pieces of the Llama 3 benchmark (bench_llama3.py, make_bench_data.py; named llama3_common so it
does not collide with benchmarks/esm2/common.py in one test session):
paths, the real-genome windows, fixed-length batches, models with identical
weights for transformers and seqfuse, and the FLOP count.

Data.  The benchmark trains on windows of real bacterial genomes
(recipes/llama3: Debian's ragout-examples and kleborate-examples, see
recipes/llama3/DATA.md).  The full training file (~38 MB) is made by
recipes/llama3/prepare_data.py, which needs apt and a network; the GPU
machine has neither.  make_bench_data.py therefore cuts a small benchmark
file out of it, BENCH_DATA (a few hundred KB: windows of exactly 8,192 bases
spread over every training genome, both strands), in a git-ignored folder
that is carried to the GPU machine.  Where it is absent, the committed
lambda-phage subset (1,024-base windows) is used and the run says so: its
windows are then joined per strand in genome order and re-cut to the needed
length (still real DNA, but one 48.5 kb genome).

Batches.  Every sequence is exactly ``max_length`` tokens (<bos>, max_length
- 2 bases, <eos>: the recipe's CausalLMDataset framing), so the packed (THD,
cu_seqlens) and padded ([B, L]) layouts of a batch hold the same tokens and
nothing is padded: padded == packed in samples and in loss, and the two
layouts differ only in the code path the model takes.
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.dirname(HERE)
ROOT = os.path.dirname(BENCH)
sys.path.insert(0, BENCH)  # harness, peers.meta
try:
    import seqfuse  # noqa: F401
except ImportError:  # a source checkout built in place
    sys.path.insert(0, os.path.join(ROOT, "python"))

import torch  # noqa: E402

#: The benchmark's genome windows (make_bench_data.py writes it; git-ignored, carried to the GPU machine).
BENCH_DATA = os.path.join(HERE, "data", "train_8192.parquet")
#: The recipe's full training windows (prepare_data.py; git-ignored).
FULL_DATA = os.path.join(ROOT, "recipes", "llama3", "data", "full", "train.parquet")
#: The committed lambda-phage subset (1,024-base windows).
SUBSET_DATA = os.path.join(ROOT, "recipes", "llama3", "data", "subset", "train.parquet")

#: CPU smoke runs: a Llama of the same structure, tiny.
TINY = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=256, head_dim=32, max_position_embeddings=131072)  # multiples of 128: FP8 block runs
#: Small Llamas of the same structure (bench_llama3_convergence.py), every GEMM dimension a multiple of 128 (FP8
#: block scaling): "small" about 25M parameters, "100M" about 75M (near the issue's ~100M convergence size).
SMALL = {"tiny": TINY,
         "small": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                       intermediate_size=1536, head_dim=64, max_position_embeddings=131072),
         "100M": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                      intermediate_size=2048, head_dim=64, max_position_embeddings=131072)}
#: The nucleotide tokenizer's 10 ids padded to 16 rows of the embedding and
#: LM head (the extra 6 logits are never targets; a multiple of 16 keeps the
#: head's GEMM aligned).  Same in every row.
VOCAB = 16

H200_BF16_MEASURED_TFLOPS = 794.0  # benchmarks/harness.py, measured on this project's H200
H200_BF16_DATASHEET_TFLOPS = 989.0  # NVIDIA's dense bf16 figure


def log(msg):
    print(f"[llama3 bench] {msg}", flush=True)


def data_path(path=None):
    """(path, note): --data when given, else BENCH_DATA, else the committed subset (logged)."""
    if path:
        return path, "given with --data"
    if os.path.isfile(BENCH_DATA):
        return BENCH_DATA, "benchmark windows (make_bench_data.py)"
    note = (f"{os.path.relpath(BENCH_DATA, ROOT)} is not here (make it with benchmarks/llama3/make_bench_data.py "
            "where recipes/llama3/data/full is prepared, and carry it): FALLING BACK to the committed lambda-phage "
            "subset, windows joined per strand and re-cut (one 48.5 kb genome, not the bacterial genomes)")
    log(note)
    return SUBSET_DATA, note


def load_windows(path):
    """The rows of a genome-window Parquet file (recipes/llama3 schema) as dicts."""
    import pyarrow.parquet as pq

    cols = [c for c in ("id", "sequence", "genome", "strand", "start", "end")
            if c in pq.read_schema(path).names]
    t = pq.read_table(path, columns=cols).to_pydict()
    return [dict(zip(cols, vals)) for vals in zip(*(t[c] for c in cols))]


def fixed_length_sequences(rows, bases):
    """Sequences of exactly ``bases`` bases: each window long enough gives
    non-overlapping pieces of that length; when none is long enough (the
    committed 1,024-base subset at 8,192), the windows of each (genome,
    strand) are joined in coordinate order first (the subset's windows tile
    the genome) and the joined sequence is cut."""
    if bases < 1:
        raise ValueError(f"fixed_length_sequences: bases must be >= 1, got {bases}")
    long_enough = [r["sequence"] for r in rows if len(r["sequence"]) >= bases]
    if long_enough:
        srcs = long_enough
    else:
        groups = {}
        for r in sorted(rows, key=lambda r: (r.get("genome", ""), r.get("strand", ""), r.get("start", 0))):
            groups.setdefault((r.get("genome", ""), r.get("strand", "")), []).append(r["sequence"])
        srcs = ["".join(g) for g in groups.values()]
    out = [s[i:i + bases] for s in srcs for i in range(0, len(s) - bases + 1, bases)]
    if not out:
        raise ValueError(f"fixed_length_sequences: no {bases}-base sequence can be cut from {len(rows)} window(s)")
    return out


def tokenizer():
    from seqfuse.data.nucleotide import NucleotideTokenizer

    return NucleotideTokenizer()


def make_batches(seqs, n, *, max_length, batch_size, seed=0):
    """The first ``n`` packed batches (cycling epochs) of the recipe's causal-LM
    loader over ``seqs`` (each exactly max_length - 2 bases), ``batch_size``
    sequences of ``max_length`` tokens each, and the same batches padded
    ([B, L] views: no padding).  Returns (packed, padded)."""
    from seqfuse.data import build_causal_lm_loader

    tok = tokenizer()
    loader = build_causal_lm_loader(seqs, tok, max_tokens=batch_size * max_length, max_length=max_length,
                                    packed=True, pad_to_multiple_of=16, seed=seed)
    packed = []
    while len(packed) < n:
        before = len(packed)
        for b in loader:
            if int(b["num_sequences"]) != batch_size or int(b["max_seqlen"]) != max_length or \
                    b["input_ids"].numel() != batch_size * max_length:
                continue  # an epoch's last, partial batch: every timed batch has the same shape
            packed.append(b)
            if len(packed) == n:
                break
        if len(packed) == before:
            raise ValueError(f"make_batches: {len(seqs)} sequence(s) give no full batch of {batch_size}")
    padded = [to_padded(b, batch_size, max_length) for b in packed]
    return packed, padded


def to_padded(b, batch_size, max_length):
    """A packed batch of equal-length sequences as [B, L] (a view: same tokens, no mask)."""
    return {"input_ids": b["input_ids"].view(batch_size, max_length),
            "labels": b["labels"].view(batch_size, max_length), "num_tokens": int(b["num_tokens"])}


def seqfuse_config(size):
    from seqfuse.hf import SeqfuseLlamaConfig, llama3_config

    tok = tokenizer()
    ids = dict(vocab_size=VOCAB, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
               eos_token_id=tok.eos_token_id)
    if size in SMALL:
        return SeqfuseLlamaConfig(**SMALL[size], **ids, rms_norm_eps=1e-5, tie_word_embeddings=True,
                                  rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=32.0,
                                                       low_freq_factor=1.0, high_freq_factor=4.0,
                                                       original_max_position_embeddings=8192))
    return llama3_config(size, **ids)


def build_hf(size, device, dtype, seed=0, attn="sdpa"):
    """transformers' LlamaForCausalLM of a published Llama 3 shape (vocabulary
    VOCAB), seeded random init (transformers' own), sdpa attention."""
    from transformers import LlamaForCausalLM

    from seqfuse.hf.llama_config import to_hf_config

    torch.manual_seed(seed)
    cfg = to_hf_config(seqfuse_config(size))
    with torch.device(device):
        model = LlamaForCausalLM._from_config(cfg, attn_implementation=attn, dtype=dtype)
    model = model.to(device=device, dtype=dtype)
    rope = model.model.rotary_emb
    if rope.inv_freq.dtype != torch.float32:  # as from_pretrained(dtype=) keeps it
        from transformers.models.llama import modeling_llama

        model.model.rotary_emb = modeling_llama.LlamaRotaryEmbedding(model.config).to(device)
    return model


def build_seqfuse(size, device, dtype, seed=0):
    """SeqfuseLlamaForCausalLM with exactly the weights build_hf(size, seed) gets."""
    from seqfuse.hf.llama_convert import from_hf_model

    hf = build_hf(size, device, dtype, seed=seed)
    model = from_hf_model(hf)
    del hf
    return model


def perturb_one_ulp(model, seed):
    """Move every nonzero parameter element by one bf16 ulp (a step of the
    bf16 bit pattern; for float32, the same step in its upper 16 bits) with
    a random sign: the control rows' initial weights (bench_llama3's
    seqfuse_bf16_perturbed_packed, bench_llama3_convergence's
    seqfuse_bf16_perturbed), whose distance from the unperturbed row is the
    natural divergence of the training, FP8 or not."""
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dtype == torch.bfloat16:
                bits, step = p.view(torch.int16), 1
            elif p.dtype == torch.float32:
                bits, step = p.view(torch.int32), 1 << 16
            else:
                raise TypeError(f"perturb_one_ulp: parameter dtype {p.dtype} (bf16 or float32 expected)")
            sign = torch.randint(0, 2, p.shape, generator=g).to(p.device) * 2 - 1
            sign[p == 0] = 0  # zeros stay (an embedding's padding row): a step below +0 is a NaN pattern
            bits.add_((sign * step).to(bits.dtype))
    return model


def forward_loss(model, batch, device, packed):
    """The causal-LM loss of one batch: packed THD (cu_seqlens) for seqfuse's
    packed rows, [B, L] without a mask otherwise (nothing is padded)."""
    ids = batch["input_ids"].to(device, non_blocking=True)
    labels = batch["labels"].to(device, non_blocking=True)
    if packed:
        return model(input_ids=ids, labels=labels, cu_seqlens=batch["cu_seqlens"].to(device, non_blocking=True),
                     max_seqlen=int(batch["max_seqlen"])).loss
    return model(input_ids=ids, labels=labels).loss


def train_flops(lengths, cfg):
    """Useful training FLOPs (forward + backward = 3 x forward) of sequences of
    ``lengths`` tokens: the GEMMs (QKV, output projection, SwiGLU MLP's gate,
    up and down, LM head) at 2 FLOPs per multiply-add, and causal attention
    (QK^T and PV over the lower triangle only: 2 x s^2 x heads x head_dim per
    layer and sequence).  Embedding lookups, norms, RoPE and the loss are not
    counted."""
    h, f, L, V = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.vocab_size
    d = cfg.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    per_token = L * 2 * (h * (q + 2 * kv) + q * h + 3 * h * f) + 2 * h * V
    total = 0
    for s in lengths:
        total += s * per_token + L * 2 * s * s * q
    return 3 * total
