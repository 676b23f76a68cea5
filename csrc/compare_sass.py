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


def normalize(text, same_as_anon=()):
    text = ANON.sub("(anon)", text)
    for ns in same_as_anon:  # a named namespace that took over from an anonymous one
        text = re.sub(rf"(?<!\d){len(ns)}{ns}(?=\d|E|I)", "(anon)", text)
    return text


def sass_by_kernel(obj, same_as_anon):
    """{kernel: (instruction lines, resource line)} of one object."""
    tool = cuobjdump()
    sass = subprocess.run([tool, "-sass", obj], check=True, capture_output=True, text=True).stdout
    kernels, name = {}, None
    for line in sass.splitlines():
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            name = normalize(m.group(1), same_as_anon)
            if name in kernels:
                sys.exit(f"compare_sass: {name} twice in {obj}")
            kernels[name] = []
        elif name is not None and line.strip().startswith(("/*", ".headerflags")):
            # cuobjdump pads the columns to the object's longest line: compare with single spaces
            kernels[name].append(re.sub(r"\s+", " ", normalize(line.strip(), same_as_anon)))
    res = subprocess.run([tool, "-res-usage", obj], check=True, capture_output=True, text=True).stdout
    usage = {}
    lines = res.splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"\s*Function (\S+):", line)
        if m and i + 1 < len(lines):
            usage[normalize(m.group(1), same_as_anon)] = lines[i + 1].strip()
    return {k: (v, usage.get(k, "")) for k, v in kernels.items()}


def pooled(objs, same_as_anon):
    out = {}
    for obj in objs:
        for k, v in sass_by_kernel(obj, same_as_anon).items():
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
    args = ap.parse_args()
    old, new = pooled(args.old, args.same_as_anon), pooled(args.new, args.same_as_anon)
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
