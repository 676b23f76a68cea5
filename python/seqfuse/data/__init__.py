"""seqfuse.data: sequence data for training (readers, tokenizers, masking,
packing, token-budget batching and a resumable loader).

Pure Python over torch and numpy; pyarrow only for Parquet. The pipeline:

    records  read_fasta / read_parquet / load_sequences        (fasta.py, parquet.py)
    ids      EsmTokenizer / NucleotideTokenizer    (tokenizers.py, nucleotide.py)
    sample   MLMDataset: crop, <cls> ... <eos>, MLM masking    (dataset.py, masking.py)
    batches  TokenBudgetBatchSampler: <= max_tokens per batch  (batching.py)
    layout   PackedTHDCollator (cu_seqlens) / PaddedBSHDCollator (collate.py)
    loader   ResumableDataLoader with state_dict               (loader.py)
"""
from .batching import TokenBudgetBatchSampler
from .collate import PackedTHDCollator, PaddedBSHDCollator, batch_to_device
from .dataset import MLMDataset, TokenizedSequences
from .fasta import SequenceRecord, read_fasta, write_fasta
from .loader import ResumableDataLoader, build_mlm_loader
from .masking import IGNORE_INDEX, mlm_mask, sample_generator, sample_seed
from .parquet import iter_records, load_sequences, read_parquet, write_parquet
from .nucleotide import NUCLEOTIDE_VOCAB, NucleotideTokenizer, reverse_complement
from .tokenizers import ESM2_VOCAB, CharTokenizer, EsmTokenizer

__all__ = [
    "SequenceRecord", "read_fasta", "write_fasta",
    "read_parquet", "write_parquet", "iter_records", "load_sequences",
    "CharTokenizer", "EsmTokenizer", "NucleotideTokenizer", "ESM2_VOCAB", "NUCLEOTIDE_VOCAB",
    "reverse_complement",
    "IGNORE_INDEX", "mlm_mask", "sample_seed", "sample_generator",
    "TokenizedSequences", "MLMDataset",
    "PackedTHDCollator", "PaddedBSHDCollator", "batch_to_device",
    "TokenBudgetBatchSampler",
    "ResumableDataLoader", "build_mlm_loader",
]
