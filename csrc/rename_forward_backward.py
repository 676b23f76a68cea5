#!/usr/bin/env python3
"""One spelling for the two passes: forward / backward, never fwd / bwd.

Python has to say forward and backward (torch's autograd.Function and
nn.Module use those names), so the project spells them the same way
everywhere: C functions, kernels, structs and macros, file names, the _C
binding names, seqfuse.ops functions, Python identifiers, the check programs,
tests, benchmark scripts, setup.py and the docs (issue 24, item 7).

This script does the rename and keeps it done:

    python3 csrc/rename_forward_backward.py            # rewrite the tree
    python3 csrc/rename_forward_backward.py --dry-run  # say what would change
    python3 csrc/rename_forward_backward.py --check    # exit 1 if fwd/bwd is left

It works on the files git tracks (outside a git checkout: a walk of the tree
that skips build outputs), limited to source and text files by suffix
(SOURCE_SUFFIXES); JSON, Parquet, images and logs are data, and
benchmarks/results/ is history (EXCLUDED).  It lives in csrc/ beside
compare_sass.py and build_checks.sh, the other maintenance scripts, because
the repository has no tools/ folder and the layout in the design notes has
no place for one.

The rewrite is word-aware: fwd / Fwd / FWD become forward / Forward / FORWARD
(bwd alike) where they stand as a word or as a part of an identifier
(snake_case, camelCase, after digits: attn_fwd_cuda, kBwdThreads,
SF_ATTN_BWD_TILES_CUH, sm90fwd), not inside another word.  Tracked files
whose names hold the spelling are renamed with git mv.  Occurrences that
must stay are listed in ALLOWED with the reason; they are neither rewritten
nor reported.  Before anything is written the script looks for collisions:
a renamed identifier that already exists, spelled the new way, in the same
file's code (``fwd`` next to an existing ``forward``; comments and strings
do not count, and in Python an attribute only meets attributes) would change
what a name refers to, so the run stops and names them.  Each is then
settled by hand in one of two lists: OVERRIDES gives that file's name
another new spelling (a local ``bwd`` inside ``def backward`` becomes
``backward_args``), REVIEWED records why the plain rename is harmless.

--check is stricter than the rewrite: it reports any fwd or bwd, in any
case and inside any word, in the scoped files and their names, that ALLOWED
does not cover.  tests/test_spelling.py runs it, so the spelling cannot
drift back.  Running the rewrite twice changes nothing the second time, and
files are visited in sorted order, so two runs on one tree give one result.
"""
import argparse
import fnmatch
import io
import os
import re
import subprocess
import sys
import tokenize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# the old spelling -> the project's spelling
SPELLING = {"fwd": "forward", "bwd": "backward"}

# text files the rewrite and the check read (by suffix, or by whole name)
SOURCE_SUFFIXES = (".py", ".c", ".h", ".cu", ".cuh", ".cpp", ".hpp", ".sh", ".md", ".rst", ".txt",
                   ".yaml", ".yml", ".toml", ".cfg", ".ini", ".gitignore")
SOURCE_NAMES = ("Makefile", "run")  # the Makefile and .ci/run

# (glob, reason): files left out of both the rewrite and the check
EXCLUDED = [
    ("benchmarks/results/*", "measured results and logs as they were written: history, not source "
                             "(no script reads their fwd/bwd row or key names back)"),
]

# (glob, regex, reason): occurrences inside a match of regex, in files matching glob, stay
ALLOWED = [
    ("*", r"\bmax_(fwd|bwd)\b",
     "Transformer Engine's API: its Format members carry max_fwd / max_bwd "
     "(Format.HYBRID.value.max_fwd), and code ported from TE reads them from seqfuse.common.recipe"),
    ("*", r"\bFP8(Fwd|Bwd)Tensors\b",
     "Transformer Engine's API: its GEMM operand index enums are FP8FwdTensors / FP8BwdTensors "
     "(seqfuse.quantization exports them under TE's names)"),
    ("README.md", r"column sm90bwd",
     "names a column of benchmarks/results/attn.json as that file spells it (history, not rewritten)"),
    ("*", r"\bcustom_(fwd|bwd)\b",
     "torch's API: torch.amp.custom_fwd / custom_bwd decorate autograd Functions"),
    ("csrc/compare_sass.py", r"\b(fwd|bwd)=(forward|backward)\b|\(fwd, Fwd, FWD\)|_Z15norm_fwd_kernel",
     "compare_sass's --rename help: its example maps the old kernel names onto the new ones"),
    ("python/seqfuse/ops/attn/_routing.py", r'"SEQFUSE_ATTN_(FWD|BWD)_KERNEL": "SEQFUSE_ATTN_(FORWARD|BACKWARD)_KERNEL"',
     "the old names of the kernel-choice environment variables, kept to refuse them with their new name "
     "(a variable set under its old name must not be ignored silently)"),
]

# (path, reason): whole files that keep the old spelling (neither rewritten, nor moved, nor reported)
ALLOWED_FILES = [
    ("csrc/rename_forward_backward.py", "this script: it names the old spelling to find it"),
    ("tests/test_spelling.py", "the test of this script: it writes the old spelling to see it found and rewritten"),
]

# (path, old identifier, new identifier, reason): plain code names spelled
# otherwise than the general rule gives, where its result would read badly
OVERRIDES = [
    ("python/seqfuse/distributed/context_parallel.py", "bwd", "backward_args",
     "the attention backward's keywords, a local of the autograd backward itself: 'backward' there "
     "would shadow the method's own name"),
    ("benchmarks/peers/bench_te_modules.py", "fwd", "forward_flops",
     "flops(): the forward pass's FLOP count (the file has forward() methods and arguments)"),
    ("benchmarks/peers/bench_torchao.py", "fwd", "forward_step",
     "the closure that runs one forward (the file's modules have forward() methods)"),
]

# (path, old identifier, reason): collisions looked at and found harmless
REVIEWED = [
]

# one pass over the text; the match itself says which spelling replaces it
_WORD_PATTERNS = []
_REPLACEMENT = {}
for _old, _new in SPELLING.items():
    # lower case: not inside a lower-case word (attn_fwd_cuda, sm90fwd, fwd+bwd; not "xfwdy")
    _WORD_PATTERNS.append(rf"(?<![a-z]){_old}(?![a-z])")
    # Capitalized: a camelCase part (kFwdElems, FwdParams, FP8FwdTensors)
    _WORD_PATTERNS.append(rf"{_old.capitalize()}(?![a-z])")
    # UPPER: not inside an upper-case word (SEQFUSE_ATTN_FWD_KERNEL, BWD_FACTOR)
    _WORD_PATTERNS.append(rf"(?<![A-Z]){_old.upper()}(?![A-Z])")
    _REPLACEMENT.update({_old: _new, _old.capitalize(): _new.capitalize(), _old.upper(): _new.upper()})
_WORD = re.compile("|".join(_WORD_PATTERNS))
_ANY = re.compile("|".join(SPELLING), re.IGNORECASE)
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ALLOWED = [(glob, re.compile(rx), reason) for glob, rx, reason in ALLOWED]


def _is_source(path):
    name = os.path.basename(path)
    return name.endswith(SOURCE_SUFFIXES) or name in SOURCE_NAMES


def _excluded(path):
    return any(fnmatch.fnmatch(path, glob) for glob, _ in EXCLUDED)


def _in_git(root):
    probe = subprocess.run(["git", "-C", root, "rev-parse", "--show-toplevel"], capture_output=True, text=True)
    return probe.returncode == 0 and os.path.realpath(probe.stdout.strip()) == os.path.realpath(root)


def _listed_files(root):
    """Paths (relative, '/'-separated, sorted) of the files in scope."""
    git = subprocess.run(["git", "-C", root, "ls-files", "-z"], capture_output=True)
    if git.returncode == 0 and _in_git(root):
        paths = [p for p in git.stdout.decode("utf-8").split("\0") if p]
    else:
        print(f"rename_forward_backward: {root} is not a git checkout ({git.stderr.decode().strip()}); "
              "walking the tree instead, build outputs skipped", file=sys.stderr)
        skip = {".git", "build", "dist", "bin", "__pycache__", ".pytest_cache"}
        paths = []
        for folder, dirs, files in os.walk(root):
            dirs[:] = [d for d in dirs if d not in skip and not d.endswith(".egg-info")]
            paths += [os.path.relpath(os.path.join(folder, f), root).replace(os.sep, "/") for f in files]
    return sorted(p for p in paths if _is_source(p) and not _excluded(p)
                  and p not in {f for f, _ in ALLOWED_FILES} and os.path.isfile(os.path.join(root, p)))


def _allowed_spans(path, text):
    spans = []
    for glob, rx, _ in _ALLOWED:
        if fnmatch.fnmatch(path, glob):
            spans += [m.span() for m in rx.finditer(text)]
    return spans


def _inside(pos, spans):
    return any(a <= pos < b for a, b in spans)


def respell(text, spans=()):
    """text with every word-aware fwd/bwd rewritten, except inside spans."""
    return _WORD.sub(lambda m: m.group() if _inside(m.start(), spans) else _REPLACEMENT[m.group()], text)


def respell_path(path):
    return "/".join(respell(part) for part in path.split("/"))


_C_NOISE = re.compile(r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'', re.S)


def _code_names(path, text):
    """{(kind, name, offset)} of the identifiers the code of a Python or C file uses,
    kind "." for a Python attribute (after .) and "" for any other name; comments
    and string literals left out.  None for files that are not code (prose:
    a word there names nothing)."""
    if path.endswith(".py"):
        try:
            tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
        except (tokenize.TokenError, SyntaxError) as e:
            print(f"rename_forward_backward: {path} does not tokenize ({e}); its names are checked as C's "
                  "(comments and strings left out by the C rules)", file=sys.stderr)
            tokens = None
        if tokens is not None:
            starts = [0]
            for line in io.StringIO(text).readlines():  # the lines tokenize counts (split at \n only)
                starts.append(starts[-1] + len(line))
            names, prev = set(), None
            for tok in tokens:
                if tok.type == tokenize.NAME:
                    names.add(("." if prev == "." else "", tok.string, starts[tok.start[0] - 1] + tok.start[1]))
                if tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT):
                    prev = tok.string
            return names
    if path.endswith((".py", ".c", ".h", ".cu", ".cuh", ".cpp", ".hpp")):
        # one kind for every C name: a struct's members are declared as plain
        # names, so members and locals are not told apart (the safe side)
        code = _C_NOISE.sub(lambda m: " " * len(m.group()), text)
        return {("", m.group(), m.start()) for m in _IDENT.finditer(code)}
    return None


def _collisions(path, text):
    """(old, new, line) of code identifiers the rewrite would give a name the
    same file's code already uses in the same role (plain name or member)."""
    names = _code_names(path, text)
    if names is None:
        return []
    spans = _allowed_spans(path, text)
    used = {(kind, name) for kind, name, _ in names}
    settled = {(p, o) for p, o, _ in REVIEWED} | {(p, o) for p, o, _, _ in OVERRIDES}
    found = {}
    for kind, old, at in sorted(names, key=lambda n: n[2]):
        if not _ANY.search(old) or (path, old) in settled or _inside(at, spans):
            continue
        new = respell(old)
        if new != old and (kind, new) in used:
            found.setdefault((old, new), text.count("\n", 0, at) + 1)
    return sorted((old, new, line) for (old, new), line in found.items())


def _overridden(path, text):
    """text with OVERRIDES' names for this file put in, at code positions only
    (a comment's or string's word is left to the general rewrite)."""
    mine = {old: new for p, old, new, _ in OVERRIDES if p == path}
    if not mine:
        return text
    names = _code_names(path, text) or set()
    spots = sorted((at, name) for kind, name, at in names if kind == "" and name in mine)
    out, last = [], 0
    for at, name in spots:
        out += [text[last:at], mine[name]]
        last = at + len(name)
    out.append(text[last:])
    return "".join(out)


def leftovers(path, text):
    """(line number, line) of every fwd/bwd (any case, any position) not allowed."""
    spans = _allowed_spans(path, text)
    out = []
    for m in _ANY.finditer(text):
        if not _inside(m.start(), spans):
            line = text.count("\n", 0, m.start()) + 1
            out.append((line, text.splitlines()[line - 1].strip()))
    return out


def check(root):
    bad = 0
    for path in _listed_files(root):
        if _ANY.search(path):
            print(f"{path}: the file name spells fwd/bwd")
            bad += 1
        with open(os.path.join(root, path), encoding="utf-8") as f:
            text = f.read()
        for line, content in leftovers(path, text):
            print(f"{path}:{line}: {content}")
            bad += 1
    if bad:
        print(f"rename_forward_backward --check: {bad} place(s) spell fwd/bwd; the project spells "
              "forward/backward (run csrc/rename_forward_backward.py, or add an ALLOWED entry with its reason)")
        return 1
    print("rename_forward_backward --check: no fwd/bwd outside the allowed places")
    return 0


def rewrite(root, dry_run):
    files = _listed_files(root)
    texts, collisions = {}, []
    for path in files:
        with open(os.path.join(root, path), encoding="utf-8") as f:
            texts[path] = f.read()
        collisions += [(path, old, new, line) for old, new, line in _collisions(path, texts[path])]
    if collisions:
        for path, old, new, line in collisions:
            print(f"{path}:{line}: renaming {old} would give {new}, a name this file's code already uses")
        print("rename_forward_backward: stopped before writing anything; rename these by hand, "
              "or list them in REVIEWED with why they are safe")
        return 2
    changed = 0
    for path in files:
        text = _overridden(path, texts[path])
        new = respell(text, _allowed_spans(path, text))
        if new != texts[path]:
            changed += 1
            spans = _allowed_spans(path, texts[path])
            count = sum(1 for m in _WORD.finditer(texts[path]) if not _inside(m.start(), spans))
            print(f"{'would rewrite' if dry_run else 'rewrote'} {path} ({count} word(s))")
            if not dry_run:
                with open(os.path.join(root, path), "w", encoding="utf-8") as f:
                    f.write(new)
    moved, in_git = 0, _in_git(root)
    for path in files:
        target = respell_path(path)
        if target == path:
            continue
        if os.path.exists(os.path.join(root, target)):
            print(f"rename_forward_backward: cannot move {path}: {target} exists", file=sys.stderr)
            return 2
        moved += 1
        print(f"{'would move' if dry_run else 'moved'} {path} -> {target}")
        if not dry_run:
            if in_git:
                subprocess.run(["git", "-C", root, "mv", path, target], check=True)
            else:
                print(f"rename_forward_backward: {root} is not a git checkout: {path} moved without git mv",
                      file=sys.stderr)
                os.replace(os.path.join(root, path), os.path.join(root, target))
    print(f"rename_forward_backward: {changed} file(s) {'to rewrite' if dry_run else 'rewritten'}, "
          f"{moved} {'to move' if dry_run else 'moved'}")
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="report fwd/bwd left; exit 1 if any")
    mode.add_argument("--dry-run", action="store_true", help="say what the rewrite would change; change nothing")
    ap.add_argument("--root", default=ROOT, help="the repository to work on (default: this script's)")
    args = ap.parse_args()
    root = os.path.abspath(args.root)
    return check(root) if args.check else rewrite(root, args.dry_run)


if __name__ == "__main__":
    sys.exit(main())
