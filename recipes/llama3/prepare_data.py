#!/usr/bin/env python3
"""Prepare the Llama 3 recipe's real DNA: whole bacterial genome assemblies
and the lambda phage genome from Debian packages, cut into windows, split
train / validation by whole genome, written as Parquet.

Steps (deterministic: two runs give byte-identical files with one pyarrow):
  1. ``apt-get download`` + ``dpkg -x`` ragout-examples, kleborate-examples
     and bowtie2-examples into --cache-dir (reused when already there;
     seqfuse.data.debian), read their versions and copyright files;
  2. read the 21 genomes of ``GENOMES`` (FASTA, .gz / .xz);
  3. cut every record into windows of --window bases (default 8192) every
     --stride bases (default: the window, so no overlap), the last window
     aligned to the record's end; records shorter than the window are one
     window when >= --min-length bases; both strands unless --strands +;
     windows with more than --max-n-fraction non-ACGT bases are dropped
     (seqfuse.data.genome states the rule);
  4. validation = the windows of the genomes in --validation-genomes (default
     ``VALIDATION_GENOMES``, one strain each of three species), train = all
     others: no window of a validation genome is in train;
  5. write <out>/train.parquet, <out>/validation.parquet (columns id,
     sequence, genome, record_id, strand, start, end; sources, licences and
     settings in the ``seqfuse.dataset`` metadata) and <out>/manifest.json;
  6. with --subset-dir, write the committed subset: lambda phage only, short
     windows (--subset-window 1024), split by region because it is one
     genome: validation = windows inside its last --subset-validation-bases
     bases, train = windows inside the rest (none crosses the cut).

Sources and licences: recipes/llama3/DATA.md.

    python recipes/llama3/prepare_data.py                      # -> recipes/llama3/data/full
    python recipes/llama3/prepare_data.py --window 4096 --strands +
    python recipes/llama3/prepare_data.py --subset-only --subset-dir recipes/llama3/data/subset
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))

from seqfuse.data.debian import DebianPackageError, fetch_package, sha256_file  # noqa: E402
from seqfuse.data.fasta import SequenceRecord, read_fasta  # noqa: E402
from seqfuse.data.genome import genome_windows, write_windows  # noqa: E402


@dataclass(frozen=True)
class Genome:
    name: str  # unit of the split; no '/' or spaces
    package: str
    path: str  # inside the package
    organism: str
    accession: str  # as the FASTA headers give it (NCBI GenBank / RefSeq)


RAGOUT = "usr/share/doc/ragout/examples"
KLEB = "usr/share/doc/kleborate/examples/data"
# The reference genomes of ragout-examples (its *_contigs.fasta.gz files are
# draft assemblies of strains whose finished genome is listed here, so they
# are left out: the same strain twice), the four Klebsiella assemblies of
# kleborate-examples, and bowtie2-examples' lambda phage.
GENOMES = (
    Genome("ecoli_K12_MG1655", "ragout-examples", f"{RAGOUT}/E.Coli/references/MG1655-K12.fasta.gz",
           "Escherichia coli K-12 MG1655", "(header: K-12-MG1655)"),
    Genome("ecoli_DH1", "ragout-examples", f"{RAGOUT}/E.Coli/references/DH1.fasta.gz",
           "Escherichia coli DH1", "NC_017625.1"),
    Genome("vcholerae_H1", "ragout-examples", f"{RAGOUT}/V.Cholerae/references/H1.fasta.gz",
           "Vibrio cholerae H1", "AKGH01000001.1, AKGH01000002.1"),
    Genome("vcholerae_O1_Inaba_G4222", "ragout-examples", f"{RAGOUT}/V.Cholerae/references/O1_Inaba.fasta.gz",
           "Vibrio cholerae O1 Inaba G4222", "CM001785.1, CM001786.1"),
    Genome("vcholerae_O1_El_Tor_N16961", "ragout-examples", f"{RAGOUT}/V.Cholerae/references/O1_biovar.fasta.gz",
           "Vibrio cholerae O1 biovar El Tor N16961", "AE003852.1, AE003853.1"),
    Genome("vcholerae_O395", "ragout-examples", f"{RAGOUT}/V.Cholerae/references/O395.fasta.gz",
           "Vibrio cholerae O395", "CP001235.1, CP001236.1"),
    Genome("hpylori_ELS37", "ragout-examples", f"{RAGOUT}/H.Pylori/references/ELS37.fasta.gz",
           "Helicobacter pylori ELS37", "NC_017063.1"),
    Genome("hpylori_G27", "ragout-examples", f"{RAGOUT}/H.Pylori/references/G27.fasta.gz",
           "Helicobacter pylori G27", "NC_011333.1"),
    Genome("hpylori_Gambia94_24", "ragout-examples", f"{RAGOUT}/H.Pylori/references/Gambia94_24.fasta.gz",
           "Helicobacter pylori Gambia94/24", "NC_017371.1"),
    Genome("hpylori_Puno120", "ragout-examples", f"{RAGOUT}/H.Pylori/references/Puno120.fasta.gz",
           "Helicobacter pylori Puno120", "NC_017378.1"),
    Genome("hpylori_SJM180", "ragout-examples", f"{RAGOUT}/H.Pylori/references/SJM180.fasta.gz",
           "Helicobacter pylori SJM180", "NC_014560.1"),
    Genome("saureus_COL", "ragout-examples", f"{RAGOUT}/S.Aureus/references/COL.fasta.gz",
           "Staphylococcus aureus COL", "NC_002951.2"),
    Genome("saureus_JKD6008", "ragout-examples", f"{RAGOUT}/S.Aureus/references/JKD6008.fasta.gz",
           "Staphylococcus aureus JKD6008", "NC_017341.1"),
    Genome("saureus_N315", "ragout-examples", f"{RAGOUT}/S.Aureus/references/N315.fasta.gz",
           "Staphylococcus aureus N315", "NC_002745.2"),
    Genome("saureus_RF122", "ragout-examples", f"{RAGOUT}/S.Aureus/references/RF122.fasta.gz",
           "Staphylococcus aureus RF122", "NC_007622.1"),
    Genome("saureus_USA300_FPR3757", "ragout-examples", f"{RAGOUT}/S.Aureus/references/USA300_FPR3757.fasta.gz",
           "Staphylococcus aureus USA300_FPR3757", "NC_007793.1"),
    Genome("kpneumoniae_HS11286", "kleborate-examples", f"{KLEB}/Klebs_HS11286.fna.xz",
           "Klebsiella pneumoniae HS11286", "GCA_000240185.2 (CP003200.1 and 6 plasmids)"),
    Genome("kpneumoniae_1084", "kleborate-examples", f"{KLEB}/Klebs_Kp1084.fna.xz",
           "Klebsiella pneumoniae 1084", "GCA_000294365.1 (CP003785.1)"),
    Genome("kpneumoniae_MGH78578", "kleborate-examples", f"{KLEB}/MGH78578.fna.xz",
           "Klebsiella pneumoniae MGH 78578", "GCA_000016305.1 (CP000647.1 and 5 plasmids)"),
    Genome("kpneumoniae_NTUH-K2044", "kleborate-examples", f"{KLEB}/NTUH-K2044.fna.xz",
           "Klebsiella pneumoniae NTUH-K2044", "GCA_000009885.1 (AP006725.1, AP006726.1)"),
    Genome("lambda_phage", "bowtie2-examples", "usr/share/doc/bowtie2/examples/reference/lambda_virus.fa.gz",
           "Enterobacteria phage lambda", "NC_001416.1"),
)
GENOME_BY_NAME = {g.name: g for g in GENOMES}
PACKAGES = tuple(dict.fromkeys(g.package for g in GENOMES))
#: Held out whole: a strain of each of three species whose other strains train.
VALIDATION_GENOMES = ("vcholerae_O395", "saureus_N315", "hpylori_Puno120")
SUBSET_GENOME = "lambda_phage"


def non_acgt_fraction(seq: str) -> float:
    return (len(seq) - sum(seq.count(c) for c in "ACGTacgt")) / len(seq) if seq else 0.0


class Windower:
    """Windows of genomes under one setting, counting what it keeps and drops."""

    def __init__(self, window, stride, strands, min_length, max_n_fraction):
        self.settings = {
            "window": window, "stride": stride, "strands": list(strands),
            "min_length": min_length, "max_n_fraction": max_n_fraction,
        }
        self.stats: dict[str, dict] = {}

    def rows(self, genome: str, records: list[SequenceRecord], regions=None):
        """Rows of ``genome``; ``regions`` maps a record id to (start, end)
        to cut only that region (the subset's region split)."""
        s = self.settings
        st = self.stats.setdefault(genome, {"records": {}, "windows": 0, "bases": 0, "dropped_non_acgt": 0})
        for rec in records:
            a, b = (regions or {}).get(rec.id, (0, len(rec.sequence)))
            st["records"][rec.id] = {"length": len(rec.sequence), "region": [a, b], "description": rec.description}
            part = SequenceRecord(rec.id, rec.sequence[a:b])
            for row in genome_windows(genome, part, window=s["window"], stride=s["stride"], strands=s["strands"],
                                      min_length=s["min_length"], offset=a):
                if non_acgt_fraction(row["sequence"]) > s["max_n_fraction"]:
                    st["dropped_non_acgt"] += 1
                    continue
                st["windows"] += 1
                st["bases"] += len(row["sequence"])
                yield row


def load_genome(packages: dict, g: Genome) -> list[SequenceRecord]:
    return list(read_fasta(packages[g.package].path(g.path)))


def describe(packages: dict, genomes, windower: Windower, split: str) -> dict:
    used = {g.package for g in genomes}
    return {
        "created_by": "recipes/llama3/prepare_data.py",
        "sources": [packages[p].provenance() for p in PACKAGES if p in used],
        "genomes": [
            {"name": g.name, "organism": g.organism, "accession": g.accession, "package": g.package, "file": g.path}
            for g in genomes
        ],
        "windows": windower.settings,
        "split": split,
        "licence_note": "see recipes/llama3/DATA.md: the genome sequences are public INSDC/RefSeq records; "
                        "each package's copyright file licence is listed under 'sources'",
    }


def write_split(path, rows, dataset, compression_level=None) -> dict:
    n = write_windows(rows, path, dataset, compression_level=compression_level)
    return {"file": os.path.basename(path), "windows": n, "sha256": sha256_file(path)}


def prepare_full(args, packages) -> None:
    unknown = sorted(set(args.validation_genomes) - set(GENOME_BY_NAME))
    if unknown:
        raise SystemExit(f"prepare_data: --validation-genomes names unknown genomes {unknown}; known: {sorted(GENOME_BY_NAME)}")
    val_names = set(args.validation_genomes)
    split_rule = f"by whole genome: validation = {sorted(val_names)}, train = every other genome"
    win = Windower(args.window, args.stride, args.strands, args.min_length, args.max_n_fraction)
    os.makedirs(args.out_dir, exist_ok=True)
    outputs = {}
    for split in ("train", "validation"):
        genomes = [g for g in GENOMES if (g.name in val_names) == (split == "validation")]
        dataset = dict(describe(packages, genomes, win, split_rule), part=split)

        def rows(genomes=genomes):
            for g in genomes:
                yield from win.rows(g.name, load_genome(packages, g))

        outputs[split] = write_split(os.path.join(args.out_dir, f"{split}.parquet"), rows(), dataset)
        outputs[split]["genomes"] = [g.name for g in genomes]
        print(f"prepare_data: {split}: {outputs[split]['windows']} windows from {len(genomes)} genomes")
    manifest = dict(describe(packages, GENOMES, win, split_rule), outputs=outputs, per_genome=win.stats)
    with open(os.path.join(args.out_dir, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=2, sort_keys=True)
        f.write("\n")


def prepare_subset(args, packages) -> None:
    g = GENOME_BY_NAME[SUBSET_GENOME]
    records = load_genome(packages, g)
    if len(records) != 1:
        raise SystemExit(f"prepare_data: expected one record in {g.path}, got {len(records)}")
    rec = records[0]
    cut = len(rec.sequence) - args.subset_validation_bases
    if cut < args.subset_window:
        raise SystemExit(f"prepare_data: --subset-validation-bases leaves less than one window of {g.name} for training")
    split_rule = (f"one genome, split by region: validation = windows inside [{cut}, {len(rec.sequence)}) of "
                  f"{rec.id}, train = windows inside [0, {cut}); none crosses the cut")
    win = Windower(args.subset_window, args.subset_window, args.strands, args.min_length, args.max_n_fraction)
    os.makedirs(args.subset_dir, exist_ok=True)
    outputs = {}
    for split, region in (("train", (0, cut)), ("validation", (cut, len(rec.sequence)))):
        dataset = dict(describe(packages, [g], win, split_rule), part=split)
        rows = win.rows(f"{g.name}", [rec], regions={rec.id: region})
        outputs[split] = write_split(os.path.join(args.subset_dir, f"{split}.parquet"), rows, dataset, compression_level=19)
        print(f"prepare_data: subset {split}: {outputs[split]['windows']} windows")
    manifest = dict(describe(packages, [g], win, split_rule), outputs=outputs)
    with open(os.path.join(args.subset_dir, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=2, sort_keys=True)
        f.write("\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out-dir", default=os.path.join(HERE, "data", "full"))
    ap.add_argument("--cache-dir", default=os.path.join(HERE, "data", "cache"),
                    help="where the .deb files are downloaded and unpacked (reused by later runs)")
    ap.add_argument("--apt-update", action="store_true", help="run apt-get update before downloading (root)")
    ap.add_argument("--window", type=int, default=8192, help="bases per window (default 8192)")
    ap.add_argument("--stride", type=int, help="bases between window starts (default: --window, no overlap)")
    ap.add_argument("--strands", default="+-", choices=["+-", "+"], help="'+-': both strands (default); '+': forward only")
    ap.add_argument("--min-length", type=int, default=1000, help="shortest record kept as a (short) window")
    ap.add_argument("--max-n-fraction", type=float, default=0.1, help="drop windows with more non-ACGT bases than this")
    ap.add_argument("--validation-genomes", nargs="+", default=list(VALIDATION_GENOMES),
                    help=f"genomes held out whole (default {' '.join(VALIDATION_GENOMES)})")
    ap.add_argument("--subset-dir", help="also write the small committed subset (lambda phage) here")
    ap.add_argument("--subset-only", action="store_true", help="write only the subset (downloads bowtie2-examples only)")
    ap.add_argument("--subset-window", type=int, default=1024)
    ap.add_argument("--subset-validation-bases", type=int, default=8192)
    args = ap.parse_args(argv)
    args.stride = args.stride or args.window
    args.strands = list(args.strands)
    if args.window < 1 or args.stride < 1 or args.subset_window < 1:
        ap.error("--window, --stride and --subset-window must be >= 1")
    if not 1 <= args.min_length <= min(args.window, args.subset_window if args.subset_dir else args.window):
        ap.error("--min-length must be in [1, window]")
    if not 0.0 <= args.max_n_fraction <= 1.0:
        ap.error("--max-n-fraction must be in [0, 1]")
    if args.subset_only and not args.subset_dir:
        ap.error("--subset-only needs --subset-dir")

    wanted = [GENOME_BY_NAME[SUBSET_GENOME].package] if args.subset_only else PACKAGES
    try:
        packages = {p: fetch_package(p, args.cache_dir, apt_update=args.apt_update) for p in wanted}
    except DebianPackageError as e:
        print(f"prepare_data: error: {e}", file=sys.stderr)
        return 1
    for p in packages.values():
        print(f"prepare_data: {p.name} {p.version} ({p.licence}) from {os.path.basename(p.deb)}")
    if not args.subset_only:
        prepare_full(args, packages)
    if args.subset_dir:
        prepare_subset(args, packages)
    return 0


if __name__ == "__main__":
    sys.exit(main())
