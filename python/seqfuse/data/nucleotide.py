"""DNA: the nucleotide tokenizer, its Hugging Face form, and reverse complements.

One token per base. Vocabulary (ids fixed, ``NUCLEOTIDE_VOCAB``):
``<pad>=0 <unk>=1 <bos>=2 <eos>=3 <mask>=4 A=5 C=6 G=7 T=8 N=9``;
``encode`` frames a sequence as ``<bos> bases <eos>``.

Character rule (the same in both paths below):
  * A C G T N are themselves; lower case (soft-masked repeats in genome
    assemblies) is folded to upper case (``uppercase=True``, the default);
  * the IUPAC ambiguity codes R Y S W K M B D H V (either case) become N
    (``iupac_to_n=True``, the default);
  * ASCII whitespace is skipped;
  * any other character (U, '-', '*', digits, non-ASCII, ...) follows the
    ``unknown`` policy: ``"N"`` (default) makes it N, one for one, so the
    token count equals the base count and genome coordinates hold;
    ``"error"`` (or ``strict=True``) raises ValueError naming the character
    and its position.
  * ``<bos>``-style special tokens written in the text are recognised.

Two encoders, tested equal on real genomes:
  * ``NucleotideTokenizer`` (a CharTokenizer): a 256-entry lookup table over
    bytes, so a whole 5 Mb genome is one numpy gather (``encode_bytes`` /
    ``encode_residues``); this is what the data loader uses.
  * ``to_hf()`` / ``save_pretrained(dir)``: the same vocabulary and rule as a
    ``tokenizers`` pipeline (normalizer: strip whitespace, fold case,
    anything not ACGTN -> N; one pre-token per character; WordLevel model;
    ``<bos> $A <eos>`` template; Fuse decoder) wrapped as transformers'
    PreTrainedTokenizerFast, saved as a directory that
    ``transformers.AutoTokenizer.from_pretrained`` loads (exports of a
    trained model ship it). A ``tokenizers`` pipeline cannot refuse a
    character, so only the ``unknown="N"`` policy has a Hugging Face form;
    ``to_hf`` on an ``"error"`` tokenizer raises instead of silently
    changing the rule.
"""
from __future__ import annotations

import os

from ._checks import as_bool, as_optional_int
from ._files import replacing
from .tokenizers import CharTokenizer, check_directory

__all__ = ["NUCLEOTIDE_VOCAB", "NucleotideTokenizer", "reverse_complement"]

#: DNA vocabulary: specials first, then the four bases and N (any base).
NUCLEOTIDE_VOCAB = ["<pad>", "<unk>", "<bos>", "<eos>", "<mask>", "A", "C", "G", "T", "N"]

IUPAC_AMBIGUOUS = "RYSWKMBDHV"

# Watson-Crick complement, IUPAC codes included (R=A/G <-> Y=C/T, K <-> M,
# B <-> V, D <-> H; S, W, N are their own complements); case is kept.
_COMPLEMENT = str.maketrans("ACGTRYKMBVDHSWNacgtrykmbvdhswn", "TGCAYRMKVBHDSWNtgcayrmkvbhdswn")
_COMPLEMENTABLE = frozenset("ACGTRYKMBVDHSWNacgtrykmbvdhswn")


def reverse_complement(seq: str) -> str:
    """The reverse complement of a DNA string (IUPAC codes complemented,
    case kept). Any other character raises ValueError: a complement of an
    unknown symbol would be a guess."""
    if not isinstance(seq, str):
        raise TypeError(f"reverse_complement: argument 'seq' must be a str, got {type(seq).__name__}")
    bad = set(seq) - _COMPLEMENTABLE
    if bad:
        raise ValueError(
            f"reverse_complement: argument 'seq' holds {sorted(bad)!r}, which are not IUPAC nucleotide codes"
        )
    return seq.translate(_COMPLEMENT)[::-1]


class NucleotideTokenizer(CharTokenizer):
    """DNA tokenizer for causal or masked LMs (see the module note for the
    character rule). ``strict=True`` is ``unknown="error"``."""

    def __init__(
        self,
        unknown: str = "N",
        *,
        strict: bool = False,
        uppercase: bool = True,
        iupac_to_n: bool = True,
        parse_special_tokens: bool = True,
    ):
        if unknown not in ("N", "error"):
            raise ValueError(f"NucleotideTokenizer: argument 'unknown' must be 'N' or 'error', got {unknown!r}")
        strict = as_bool("NucleotideTokenizer", "strict", strict)
        uppercase = as_bool("NucleotideTokenizer", "uppercase", uppercase)
        iupac_to_n = as_bool("NucleotideTokenizer", "iupac_to_n", iupac_to_n)
        if strict:
            unknown = "error"
        extra = {}
        if uppercase:
            extra.update({c.lower(): c for c in "ACGTN"})
        if iupac_to_n:
            extra.update({c: "N" for c in IUPAC_AMBIGUOUS})
            if uppercase:
                extra.update({c.lower(): "N" for c in IUPAC_AMBIGUOUS})
        super().__init__(
            NUCLEOTIDE_VOCAB,
            bos_token="<bos>",
            random_tokens=list("ACGT"),
            unknown=unknown,
            parse_special_tokens=parse_special_tokens,
            extra_char_map=extra,
        )
        self.uppercase = uppercase
        self.iupac_to_n = iupac_to_n

    # -- Hugging Face form ------------------------------------------------
    def to_hf(self, model_max_length: int | None = None):
        """This tokenizer as a transformers PreTrainedTokenizerFast (ids and
        character rule identical; see the module note)."""
        if self.unknown != "N":
            raise ValueError(
                "NucleotideTokenizer.to_hf: a Hugging Face tokenizer cannot refuse characters, so only "
                f"unknown='N' has a Hugging Face form (this tokenizer has unknown={self.unknown!r})"
            )
        if not self.parse_special_tokens:
            raise ValueError(
                "NucleotideTokenizer.to_hf: Hugging Face tokenizers always recognise special tokens in the "
                "text; build this tokenizer with parse_special_tokens=True"
            )
        model_max_length = as_optional_int("NucleotideTokenizer.to_hf", "model_max_length", model_max_length, 1)
        from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
        from transformers import PreTrainedTokenizerFast

        steps = [normalizers.Replace(Regex("[ \t\n\r\x0b\x0c]"), "")]  # the lookup table's whitespace
        if self.uppercase:
            steps += [normalizers.Replace(c.lower(), c) for c in "ACGTN"]
        # IUPAC codes and every other character: N (iupac_to_n only matters
        # for unknown='error', which has no Hugging Face form).
        steps.append(normalizers.Replace(Regex("[^ACGTN]"), "N"))
        tk = Tokenizer(models.WordLevel(dict(self.token_to_id), unk_token="<unk>"))
        tk.normalizer = normalizers.Sequence(steps)
        tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
        tk.post_processor = processors.TemplateProcessing(
            single="<bos> $A <eos>",
            pair="<bos> $A <eos> $B:1 <eos>:1",
            special_tokens=[("<bos>", self.bos_token_id), ("<eos>", self.eos_token_id)],
        )
        tk.decoder = decoders.Fuse()  # bases join without spaces
        tk.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in self.special_tokens])
        kwargs = {} if model_max_length is None else {"model_max_length": model_max_length}
        return PreTrainedTokenizerFast(
            tokenizer_object=tk,
            bos_token="<bos>",
            eos_token="<eos>",
            pad_token="<pad>",
            unk_token="<unk>",
            mask_token="<mask>",
            clean_up_tokenization_spaces=False,
            padding_side="right",
            **kwargs,
        )

    def save_pretrained(self, directory, model_max_length: int | None = None) -> str:
        """Write the Hugging Face tokenizer directory (tokenizer.json,
        tokenizer_config.json) that ``AutoTokenizer.from_pretrained`` loads;
        returns the directory. The config names the class
        PreTrainedTokenizerFast, which transformers 4 and 5 both know.
        Tokenizer files already in ``directory`` are replaced, as
        transformers' ``save_pretrained`` does; a ``directory`` that is a
        file is refused (NotADirectoryError)."""
        import json

        directory = check_directory("NucleotideTokenizer.save_pretrained", directory)
        self.to_hf(model_max_length).save_pretrained(directory)
        path = os.path.join(directory, "tokenizer_config.json")
        with open(path) as f:
            config = json.load(f)
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
        with replacing(path, "NucleotideTokenizer.save_pretrained") as tmp, open(tmp, "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
            f.write("\n")
        return directory
