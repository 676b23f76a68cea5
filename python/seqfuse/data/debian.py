"""Real training data from Debian's package archive: download, unpack, and
read where the data came from and under which licence.

The recipes' data (UniProt proteins, bacterial genomes, lambda phage) ship in
Debian ``*-examples`` packages, which every machine with apt reaches without
a model or data hub. ``fetch_package(name, cache_dir)``:
  1. ``apt-get download NAME`` into ``cache_dir`` (no root needed; a .deb
     already there is reused, so a second run touches no network);
  2. ``dpkg -x`` it into ``cache_dir/<deb name>/`` (unpacked into a
     temporary folder first and renamed, so an interrupted run never leaves
     a half-unpacked tree that a later run would trust);
  3. reads the package's control fields (``dpkg-deb -f``: Package, Version,
     Source) and its machine-readable copyright file
     (``usr/share/doc/NAME/copyright``: Upstream-Name, Source, and the
     licence of its ``Files: *`` stanza), and hashes the .deb.
Where apt-get or dpkg is missing, or apt cannot find the package, the error
says what to do (``apt-get update``, or fetch the .deb elsewhere and pass
its path as ``deb=``).
"""
from __future__ import annotations

import glob
import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import asdict, dataclass

__all__ = ["DebianPackageError", "DebianPackage", "fetch_package", "download_deb", "run_tool", "sha256_file",
           "read_copyright"]


class DebianPackageError(RuntimeError):
    """A package could not be downloaded, unpacked or described."""


@dataclass(frozen=True)
class DebianPackage:
    """One downloaded and unpacked package and what its files say about it."""

    name: str
    version: str
    source_package: str
    deb: str  # path of the .deb
    deb_sha256: str
    root: str  # the unpacked tree (dpkg -x)
    upstream_name: str
    upstream_source: str
    licence: str  # the licence of the copyright file's "Files: *" stanza
    copyright_file: str  # path inside the package

    def path(self, relative: str) -> str:
        """A file of the unpacked package; FileNotFoundError if absent."""
        p = os.path.join(self.root, relative)
        if not os.path.isfile(p):
            raise FileNotFoundError(f"{self.name} {self.version} has no file {relative} (unpacked at {self.root})")
        return p

    def provenance(self) -> dict:
        """The fields a dataset records about its source (no local paths)."""
        d = asdict(self)
        for k in ("deb", "root"):
            d.pop(k)
        d["deb"] = os.path.basename(self.deb)
        return d


def sha256_file(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def run_tool(cmd: list[str], cwd: str) -> str:
    """Run apt-get / dpkg / dpkg-deb in ``cwd``; its stdout.  A missing tool
    or a failed run is a DebianPackageError saying what to do."""
    try:
        return subprocess.run(cmd, cwd=cwd, check=True, capture_output=True, text=True).stdout
    except FileNotFoundError:
        raise DebianPackageError(f"{cmd[0]} is not installed: this step needs a Debian/Ubuntu system with apt and dpkg")
    except subprocess.CalledProcessError as e:
        raise DebianPackageError(
            f"{' '.join(cmd)} failed (exit {e.returncode}):\n{e.stderr.strip()}\n"
            "If apt cannot find the package, run `apt-get update` first (as root); "
            "or download the .deb elsewhere and pass its path."
        )


def download_deb(name: str, cache_dir: str, apt_update: bool) -> str:
    """The path of package ``name``'s .deb in ``cache_dir``: the newest one
    already there, else ``apt-get download`` (after ``apt-get update`` when
    ``apt_update``).  DebianPackageError where apt-get is missing or fails."""
    cached = sorted(glob.glob(os.path.join(cache_dir, f"{name}_*.deb")))
    if cached:
        return cached[-1]
    if shutil.which("apt-get") is None:
        raise DebianPackageError(
            f"apt-get is not available on this machine: fetch the package on a Debian/Ubuntu machine "
            f"(apt-get download {name}) and put the .deb in {cache_dir}"
        )
    if apt_update:
        run_tool(["apt-get", "update"], cwd=cache_dir)
    run_tool(["apt-get", "download", name], cwd=cache_dir)
    debs = sorted(glob.glob(os.path.join(cache_dir, f"{name}_*.deb")))
    if not debs:
        raise DebianPackageError(f"apt-get download {name} reported success but left no .deb in {cache_dir}")
    return debs[-1]


def _unpack(deb: str, cache_dir: str) -> str:
    dest = os.path.join(cache_dir, os.path.basename(deb)[: -len(".deb")])
    if os.path.isdir(dest):
        return dest
    if shutil.which("dpkg") is None:
        raise DebianPackageError("dpkg is not available: it is needed to unpack the .deb")
    tmp = tempfile.mkdtemp(prefix=".unpack_", dir=cache_dir)
    try:
        run_tool(["dpkg", "-x", os.path.abspath(deb), tmp], cwd=cache_dir)
        os.rename(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def _control_fields(deb: str) -> dict[str, str]:
    out = run_tool(["dpkg-deb", "-f", os.path.abspath(deb), "Package", "Version", "Source"], cwd=os.path.dirname(deb) or ".")
    fields = {}
    for line in out.splitlines():
        if ":" in line:
            k, v = line.split(":", 1)
            fields[k.strip()] = v.strip()
    if "Package" not in fields or "Version" not in fields:
        raise DebianPackageError(f"dpkg-deb -f {deb} gave no Package/Version fields:\n{out}")
    return fields


def read_copyright(path) -> dict[str, str]:
    """Upstream-Name, Source and the ``Files: *`` licence of a Debian
    machine-readable copyright file (DEP-5). ValueError if it has no
    ``Files: *`` stanza with a License field."""
    with open(path, encoding="utf-8") as f:
        stanzas = [s for s in f.read().split("\n\n") if s.strip()]

    def fields(stanza: str) -> dict[str, str]:
        out, key = {}, None
        for line in stanza.splitlines():
            if line[:1] in (" ", "\t"):
                continue  # continuation line (licence text, more copyright holders)
            if ":" in line:
                key, value = line.split(":", 1)
                out[key.strip()] = value.strip()
        return out

    header = fields(stanzas[0]) if stanzas else {}
    for stanza in stanzas:
        f = fields(stanza)
        if f.get("Files", "").split() == ["*"] and f.get("License"):
            return {
                "upstream_name": header.get("Upstream-Name", ""),
                "upstream_source": header.get("Source", ""),
                "licence": f["License"],
            }
    raise ValueError(f"read_copyright: {path} has no 'Files: *' stanza with a License field")


def fetch_package(name: str, cache_dir, *, apt_update: bool = False, deb: str | None = None) -> DebianPackage:
    """Download (or reuse) and unpack Debian package ``name`` under
    ``cache_dir``; ``deb`` uses that .deb instead of apt-get."""
    if not name or any(c.isspace() for c in name):
        raise ValueError(f"fetch_package: argument 'name' must be a package name, got {name!r}")
    cache_dir = os.path.abspath(os.fspath(cache_dir))
    os.makedirs(cache_dir, exist_ok=True)
    if deb is not None:
        if not os.path.isfile(deb):
            raise DebianPackageError(f"fetch_package: deb={deb!r}: no such file")
    else:
        deb = download_deb(name, cache_dir, apt_update)
    fields = _control_fields(deb)
    if fields["Package"] != name:
        raise DebianPackageError(f"fetch_package: {deb} is package {fields['Package']!r}, not {name!r}")
    root = _unpack(deb, cache_dir)
    rel = f"usr/share/doc/{name}/copyright"
    copyright_path = os.path.join(root, rel)
    if not os.path.isfile(copyright_path):
        raise DebianPackageError(f"fetch_package: {name} has no {rel}: its licence cannot be recorded")
    try:
        info = read_copyright(copyright_path)
    except ValueError as e:
        raise DebianPackageError(str(e)) from None
    return DebianPackage(
        name=name,
        version=fields["Version"],
        source_package=fields.get("Source", name).split()[0],
        deb=deb,
        deb_sha256=sha256_file(deb),
        root=root,
        copyright_file=rel,
        **info,
    )
