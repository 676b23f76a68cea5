"""seqfuse.data: sequence data for training (readers, tokenizers, masking,
packing, token-budget batching and a resumable loader).

Pure Python over torch and numpy; pyarrow only for Parquet. The pipeline:

    records  read_fasta / read_parquet / load_sequences        (fasta.py, parquet.py)
    ids      EsmTokenizer / NucleotideTokenizer    (tokenizers.py, nucleotide.py)
    sample   MLMDataset: crop, <cls> ... <eos>, MLM masking    (dataset.py, masking.py)
             CausalLMDataset: crop, <bos> ... <eos>, next-token labels (dataset.py)
    batches  TokenBudgetBatchSampler: <= max_tokens per batch  (batching.py)
    layout   PackedTHDCollator (cu_seqlens) / PaddedBSHDCollator (collate.py)
    loader   ResumableDataLoader with state_dict               (loader.py)
             build_mlm_loader / build_causal_lm_loader: all of it in one call
DNA: genome windows with provenance (genome.py) from Debian packages
(debian.py), for the Llama 3 recipe (recipes/llama3/prepare_data.py).

Arguments are read strictly (_checks.py): on/off flags are bools (the
string "False" is refused, not read as True), counts, ids and indices are
integers (numpy's and 0-d integer tensors too; never floats or bools, which
would be truncated or read as 0 / 1), token ids are >= 0, seeds are in
[0, 2**64 - 1]. Bad input is a TypeError / ValueError naming the argument.
"""
from .batching import TokenBudgetBatchSampler
from .collate import PackedTHDCollator, PaddedBSHDCollator, batch_to_device
from .dataset import CausalLMDataset, FramedDataset, MLMDataset, TokenizedSequences
from .fasta import SequenceRecord, read_fasta, write_fasta
from .loader import ResumableDataLoader, build_causal_lm_loader, build_mlm_loader
from .masking import IGNORE_INDEX, mlm_mask, sample_generator, sample_seed
from .genome import WINDOW_COLUMNS, genome_windows, read_dataset_metadata, window_spans, write_windows
from .parquet import iter_records, load_sequences, read_metadata, read_parquet, write_parquet, write_rows
from .nucleotide import NUCLEOTIDE_VOCAB, NucleotideTokenizer, reverse_complement
from .tokenizers import ESM2_VOCAB, CharTokenizer, EsmTokenizer

__all__ = [
    "SequenceRecord", "read_fasta", "write_fasta",
    "read_parquet", "write_parquet", "write_rows", "read_metadata", "iter_records", "load_sequences",
    "WINDOW_COLUMNS", "window_spans", "genome_windows", "write_windows", "read_dataset_metadata",
    "CharTokenizer", "EsmTokenizer", "NucleotideTokenizer", "ESM2_VOCAB", "NUCLEOTIDE_VOCAB",
    "reverse_complement",
    "IGNORE_INDEX", "mlm_mask", "sample_seed", "sample_generator",
    "TokenizedSequences", "FramedDataset", "MLMDataset", "CausalLMDataset",
    "PackedTHDCollator", "PaddedBSHDCollator", "batch_to_device",
    "TokenBudgetBatchSampler",
    "ResumableDataLoader", "build_mlm_loader", "build_causal_lm_loader",
]
