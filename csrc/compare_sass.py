#!/usr/bin/env python3
"""Compare the machine code of CUDA objects, kernel by kernel.

When kernel source only moves (a file split, a schedule moved behind a
define), its SASS must stay the same.  This script disassembles the old and
the new objects with cuobjdump (-sass and -res-usage), pairs the kernels by
name and says, per kernel, whether its instructions (text and encodings) and
its resource usage (registers, shared memory, stack) are identical.  A kernel
whose instructions and every other figure are the same but whose SHARED
figure differs is listed apart ("same code"): kernels that declare no shared
memory were seen with SHARED 0 in one module and 1024 (the 1 KB Hopper
reserves per block) in another, the figure following the module, not the
kernel's code.

Names of kernels in an anonymous namespace carry a hash of their file
(``_GLOBAL__N__7ad38020_11_act_cuda_cu_e47fb106``); they are compared with
that part replaced by ``(anon)``, so a kernel that moved to another file
still pairs with itself.  ``--same-as-anon NS`` does the same for a named
namespace NS that replaced an anonymous one (in names and in the code's
references alike).

``--rename fwd=forward,bwd=backward`` pairs kernels across a rename of
words in identifiers: the old side's names, and the names its instructions
refer to, are rewritten before the comparison.  Each OLD=NEW word is
replaced word-aware in its three spellings (fwd, Fwd, FWD), and inside an
Itanium-mangled name the length before each renamed identifier is
recomputed (``_Z15norm_fwd_kernel`` becomes ``_Z19norm_forward_kernel``), so
a renamed kernel pairs with its new self and nothing else.

    csrc/compare_sass.py --old OLD.o [OLD2.o ...] --new NEW.o [NEW2.o ...]

The old and the new side may each be several objects (a unit split in two):
their kernels are pooled per side.  Exit status 0 when every kernel of both
sides is present on both and identical or "same code", 1 otherwise.  CUOBJDUMP names the
tool where it is not on PATH.
"""
import argparse
import os
import re
import shutil
import subprocess
import sys

INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,}\*/")
ANON = re.compile(r"\d+_GLOBAL__N__[0-9a-f]{8}_\d+_[A-Za-z0-9_]+?_[0-9a-f]{8}(?=\d|E|I)")


def cuobjdump():
    tool = os.environ.get("CUOBJDUMP") or shutil.which("cuobjdump")
    if not tool:
        sys.exit("compare_sass: cuobjdump not found (set CUOBJDUMP to its path)")
    return tool


def word_renamer(pairs):
    """A function renaming the words of pairs [(old, new)] in one identifier:
    lower case not inside a lower-case word, Capitalized as a camelCase part,
    UPPER not inside an upper-case word."""
    if not pairs:
        return lambda name: name
    table, parts = {}, []
    for old, new in pairs:
        table.update({old: new, old.capitalize(): new.capitalize(), old.upper(): new.upper()})
        parts += [rf"(?<![a-z]){re.escape(old)}(?![a-z])", rf"{re.escape(old.capitalize())}(?![a-z])",
                  rf"(?<![A-Z]){re.escape(old.upper())}(?![A-Z])"]
    words = re.compile("|".join(parts))
    return lambda name: words.sub(lambda m: table[m.group()], name)


SYMBOL = re.compile(r"[A-Za-z_$][A-Za-z0-9_$]*")
IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# digits that are no <length><identifier>: a literal (Li128E), a substitution
# or template parameter (S0_, T1_), an array or vector size (A16_, Dv4_)
NOT_A_LENGTH = re.compile(r"(L[a-z]|S|T|A|Dv)$")


def rename_mangled(sym, renamer):
    """An Itanium-mangled symbol with renamer applied to each source name
    (<length><identifier>), its length recomputed.  Read left to right: a
    source name is stepped over whole, so digits ending one identifier
    (_GLOBAL__N_1) are not read as the next one's length."""
    out, i, j = [], 0, 0
    while j < len(sym):
        m = re.match(r"\d+", sym[j:])
        if not m or NOT_A_LENGTH.search(sym[:j]):
            j += len(m.group()) if m else 1
            continue
        n, end = int(m.group()), j + len(m.group())
        ident = sym[end:end + n]
        if n == 0 or len(ident) < n or not IDENT.fullmatch(ident):
            j = end
            continue
        new = renamer(ident)
        if new != ident:
            out += [sym[i:j], f"{len(new)}{new}"]
            i = end + n
        j = end + n
    out.append(sym[i:])
    return "".join(out)


def rename_symbols(text, renamer):
    """text with renamer applied to every symbol in it: plain names as they
    are, Itanium-mangled ones (_Z...) per source name."""
    return SYMBOL.sub(lambda m: rename_mangled(m.group(), renamer) if m.group().startswith("_Z")
                      else renamer(m.group()), text)


def normalize(text, same_as_anon=(), renamer=None):
    if renamer is not None:  # first, on whole mangled names (the anonymous namespace's length included)
        text = rename_symbols(text, renamer)
    text = ANON.sub("(anon)", text)
    for ns in same_as_anon:  # a named namespace that took over from an anonymous one
        text = re.sub(rf"(?<!\d){len(ns)}{ns}(?=\d|E|I)", "(anon)", text)
    return text


def sass_by_kernel(obj, same_as_anon, renamer=None):
    """{kernel: (instruction lines, resource line)} of one object."""
    tool = cuobjdump()
    sass = subprocess.run([tool, "-sass", obj], check=True, capture_output=True, text=True).stdout
    kernels, name = {}, None
    for line in sass.splitlines():
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            name = normalize(m.group(1), same_as_anon, renamer)
            if name in kernels:
                sys.exit(f"compare_sass: {name} twice in {obj}")
            kernels[name] = []
        elif name is not None and line.strip().startswith(("/*", ".headerflags")):
            # cuobjdump pads the columns to the object's longest line: compare with single spaces
            kernels[name].append(re.sub(r"\s+", " ", normalize(line.strip(), same_as_anon, renamer)))
    res = subprocess.run([tool, "-res-usage", obj], check=True, capture_output=True, text=True).stdout
    usage = {}
    lines = res.splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"\s*Function (\S+):", line)
        if m and i + 1 < len(lines):
            usage[normalize(m.group(1), same_as_anon, renamer)] = lines[i + 1].strip()
    return {k: (v, usage.get(k, "")) for k, v in kernels.items()}


def pooled(objs, same_as_anon, renamer=None):
    out = {}
    for obj in objs:
        for k, v in sass_by_kernel(obj, same_as_anon, renamer).items():
            if k in out:
                sys.exit(f"compare_sass: {k} in two objects of one side")
            out[k] = (v[0], v[1], obj)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", nargs="+", required=True)
    ap.add_argument("--new", nargs="+", required=True)
    ap.add_argument("--only-new", action="store_true",
                    help="compare only the kernels of the new side (the old may hold more: code left out)")
    ap.add_argument("--same-as-anon", nargs="*", default=[], metavar="NAMESPACE",
                    help="named namespaces compared as the anonymous one (kernels moved out of it)")
    ap.add_argument("--rename", default="", metavar="OLD=NEW[,OLD=NEW...]",
                    help="words renamed in identifiers since the old objects (fwd=forward,bwd=backward): "
                         "applied to the old side's names before pairing")
    args = ap.parse_args()
    pairs = []
    for item in filter(None, args.rename.split(",")):
        old_word, sep, new_word = item.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z]+", old_word) or not re.fullmatch(r"[A-Za-z]+", new_word):
            ap.error(f"--rename: {item!r} is not OLD=NEW with two words of letters")
        pairs.append((old_word.lower(), new_word.lower()))
    old = pooled(args.old, args.same_as_anon, word_renamer(pairs) if pairs else None)
    new = pooled(args.new, args.same_as_anon)
    same = same_code = differ = 0
    missing = []
    for k in sorted(set(old) | set(new)):
        if k not in new:
            if not args.only_new:
                missing.append(k)
            print(f"only old  {k}")
            continue
        if k not in old:
            missing.append(k)
            print(f"only new  {k}")
            continue
        (oi, ou, _), (ni, nu, _) = old[k], new[k]
        if oi == ni and ou == nu:
            same += 1
            print(f"same      {k}  ({sum(1 for l in oi if INSTRUCTION.match(l))} instructions; {nu})")
        elif oi == ni and re.sub(r"SHARED:\d+", "", ou) == re.sub(r"SHARED:\d+", "", nu):
            # the same code; only cuobjdump's SHARED figure changed with the module (see the top)
            same_code += 1
            print(f"same code {k}: only cuobjdump's SHARED differs ({ou} | {nu})")
        else:
            differ += 1
            what = "instructions" if oi != ni else "resource usage"
            print(f"DIFFERENT {k}: {what} ({len(oi)} vs {len(ni)} lines; {ou} | {nu})")
    print(f"{same} identical, {same_code} with identical instructions but another SHARED figure, "
          f"{differ} different, {len(missing)} on one side only"
          + (" (kernels only in the old objects not counted: --only-new)" if args.only_new else ""))
    return 0 if differ == 0 and not missing else 1


if __name__ == "__main__":
    sys.exit(main())
