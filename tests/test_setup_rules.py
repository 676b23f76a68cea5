"""setup.py's incremental-build rules, imported from setup.py (setuptools
runs it as __main__; importing it builds nothing): an object is reused only
when newer than its source and every csrc header; objects of other compile
settings live in another folder; the link reruns when the object set
differs from the last link's."""
import os
import time

import pytest

from helpers import setup_rules


@pytest.fixture(scope="module")
def rules():
    return setup_rules()


def test_flags_dir_is_one_folder_per_settings(rules):
    a = rules.flags_dir("/b", "c", ["gcc", "-O2"], [("SF_WITH_CUDA", "1")])
    assert a == rules.flags_dir("/b", "c", ["gcc", "-O2"], [("SF_WITH_CUDA", "1")])
    assert os.path.dirname(a) == "/b" and os.path.basename(a).startswith("c-")
    others = {rules.flags_dir("/b", "c", ["clang", "-O2"], [("SF_WITH_CUDA", "1")]),  # another compiler
              rules.flags_dir("/b", "c", ["gcc", "-O2", "-fsanitize=address"], [("SF_WITH_CUDA", "1")]),  # CFLAGS
              rules.flags_dir("/b", "c", ["gcc", "-O2"], []),  # a CPU-only build's macros
              rules.flags_dir("/b", "cuda", ["gcc", "-O2"], [("SF_WITH_CUDA", "1")])}
    assert a not in others and len(others) == 4


def test_object_reused_only_when_newer_than_source_and_headers(rules, tmp_path):
    src, obj = tmp_path / "x.c", tmp_path / "x.o"
    src.write_text("int x;\n")
    assert not rules.up_to_date(str(obj), str(src))  # no object yet
    obj.write_text("")
    future = time.time() + 1000
    os.utime(obj, (future, future))
    assert rules.up_to_date(str(obj), str(src))
    os.utime(src, (future + 10, future + 10))  # the source edited after the object
    assert not rules.up_to_date(str(obj), str(src))
    os.utime(src, (future - 10, future - 10))
    old = rules.newest_header() - 10  # an object older than some csrc header
    os.utime(obj, (old, old))
    os.utime(src, (old - 10, old - 10))
    assert not rules.up_to_date(str(obj), str(src))


def test_link_reruns_when_the_object_set_changes(rules, tmp_path):
    stamp = tmp_path / "linked.txt"
    objects = ["/b/c-1/a.o", "/b/cuda-2/k.o"]
    assert rules.objects_changed(str(stamp), objects)  # never linked
    stamp.write_text("\n".join(objects))
    assert not rules.objects_changed(str(stamp), objects)
    assert rules.objects_changed(str(stamp), ["/b/c-3/a.o", "/b/cuda-2/k.o"])  # another settings folder
    assert rules.objects_changed(str(stamp), objects[:1])
