"""Rebuild the embedded sample corpus from Debian packages.

    .venv/bin/python appliance/data/sample_corpus/rebuild.py [--cache DIR] [--latest]

Downloads the packages pinned in sources.py with `apt-get download` (run `apt-get update` first), unpacks them
with `dpkg-deb -x`, converts man pages (groff), HTML books, fortune files and source files to plain text, and
writes one gzip'd JSONL file per language (<lang>.jsonl.gz, code.jsonl.gz) next to this script. Each line is
{"text", "lang", "source": "<package>:<file>", "license"}. It also rewrites the sample-corpus section of the
top-level NOTICE with every package, version, license and what was taken.

Runs are deterministic: files are visited in an order fixed by a hash of their path, and gzip gets mtime=0,
so the same package versions give byte-identical output. Needs apt-get, dpkg-deb and groff on PATH.
"""

from __future__ import annotations

import argparse
import fnmatch
import gzip
import hashlib
import io
import json
import shutil
import subprocess
import sys
import tempfile
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from appliance.data.sample_corpus import extract_text
from appliance.data.sample_corpus.sources import SOURCES, Source

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[2]
NOTICE_BEGIN = "----- BEGIN sample corpus (written by appliance/data/sample_corpus/rebuild.py) -----"
NOTICE_END = "----- END sample corpus -----"
MIN_DOC_CHARS = 120  # shorter pieces are headers or stubs, not documents
COOKIES_PER_DOC = 20
REQUIRED_TOOLS = ("apt-get", "apt-cache", "dpkg-deb", "groff")


@dataclass(frozen=True)
class Package:
    name: str
    version: str
    source_name: str  # Debian source package
    source_version: str
    root: Path  # where the .deb was unpacked


@dataclass(frozen=True)
class Record:
    text: str
    lang: str
    source: str
    license: str

    def to_json(self) -> str:
        fields = {"text": self.text, "lang": self.lang, "source": self.source, "license": self.license}
        return json.dumps(fields, ensure_ascii=False)


def fetch(sources: tuple[Source, ...], cache: Path, work: Path, latest: bool) -> dict[str, Package]:
    """Download (unless cached) and unpack every package; returns them by name."""
    cache.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    wanted = {s.package: candidate_version(s.package) if latest else s.version for s in sources}
    missing = [name for name in wanted if not _cached_deb(cache, name, wanted[name])]
    if missing:
        specs = [f"{name}={wanted[name]}" for name in missing]
        done = subprocess.run(["apt-get", "download", *specs], cwd=cache, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(
                f"apt-get download failed for {' '.join(specs)}:\n{done.stderr.strip()}\n"
                "Run `apt-get update` first. If a pinned version left the archive, rerun with --latest "
                "and update the versions in sources.py from the NOTICE it writes."
            )
    packages = {}
    for name, version in sorted(wanted.items()):
        deb = _cached_deb(cache, name, version)
        if deb is None:
            raise SystemExit(f"{cache}: no .deb for {name} after apt-get download")
        root = work / name
        subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
        fields = subprocess.run(
            ["dpkg-deb", "-f", str(deb), "Version", "Source"], check=True, capture_output=True, text=True
        ).stdout
        info = dict(line.split(": ", 1) for line in fields.strip().splitlines())
        # "Source: manpages-l10n" or "Source: manpages-l10n (4.18.1-1)" when the versions differ.
        source_field = info.get("Source", name).split()
        source_version = source_field[1].strip("()") if len(source_field) > 1 else info["Version"]
        packages[name] = Package(name, info["Version"], source_field[0], source_version, root)
    return packages


def candidate_version(name: str) -> str:
    """The version `apt-get install` would pick now (for --latest)."""
    policy = subprocess.run(["apt-cache", "policy", name], capture_output=True, text=True).stdout
    for line in policy.splitlines():
        key, _, value = line.strip().partition(": ")
        if key == "Candidate" and value != "(none)":
            return value
    raise SystemExit(f"apt-cache policy {name}: no candidate version (is the package name right? apt-get update?)")


def _cached_deb(cache: Path, name: str, version: str) -> Path | None:
    # apt-get writes "name_version_arch.deb" with ":" in the version spelled "%3a".
    found = sorted(cache.glob(f"{name}_{version.replace(':', '%3a')}_*.deb"))
    return found[0] if found else None


def candidate_files(source: Source, root: Path) -> list[Path]:
    """The package's files that match the source's patterns, in a fixed pseudo-random order.

    Ordering by a hash of the path spreads the budget over the whole package (all man sections, all fortune
    files) instead of taking the alphabetically first files, and does not change between runs.
    """
    found: set[Path] = set()
    for pattern in source.include:
        found.update(p for p in root.glob(pattern) if p.is_file() and not p.is_symlink())
    kept = [p for p in found if not any(fnmatch.fnmatch(str(p.relative_to(root)), ex) for ex in source.exclude)]

    def order(path: Path) -> str:
        return hashlib.sha256(f"{source.package}/{path.relative_to(root)}".encode()).hexdigest()

    return sorted(kept, key=order)


def documents(source: Source, root: Path) -> Iterator[tuple[str, str, str]]:
    """(installed path, text, license) for each document the source's files yield, in candidate order."""
    seen_cookies: set[str] = set()
    for path in candidate_files(source, root):
        raw = extract_text.read_utf8(path)
        if raw is None:
            continue  # legacy 8-bit encodings: every such file here also exists as UTF-8, or is skipped
        installed = "/" + str(path.relative_to(root))
        name = path.name.removesuffix(".gz")
        license = source.license_overrides.get(name, source.license)
        if source.kind == "man":
            if extract_text.is_man_alias(raw):
                continue
            if license == "from-page":
                page_license = extract_text.man_spdx_license(raw)
                if page_license is None:
                    continue
                license = page_license
            yield installed, extract_text.man_to_text(raw, source.drop_sections), license
        elif source.kind == "html":
            yield installed, extract_text.html_to_text(raw, source.script, source.min_script_share), license
        elif source.kind == "fortune":
            cookies = []
            for cookie in extract_text.fortune_cookies(raw):
                if cookie not in seen_cookies:
                    seen_cookies.add(cookie)
                    cookies.append(cookie)
            for start in range(0, len(cookies), COOKIES_PER_DOC):
                yield installed, "\n\n".join(cookies[start : start + COOKIES_PER_DOC]), license
        else:
            yield installed, raw.rstrip() + "\n", license


def select(source: Source, package: Package, seen_texts: set[str]) -> list[Record]:
    """Documents from one source until its byte budget is spent; stubs, oversize, duplicate and untranslated
    documents are skipped."""
    records: list[Record] = []
    used = 0
    for installed, text, license in documents(source, package.root):
        size = len(text.encode("utf-8"))
        if len(text) < MIN_DOC_CHARS or size > source.max_doc_bytes:
            continue
        if source.script and extract_text.script_share(text, source.script) < source.min_script_share:
            continue
        digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
        if digest in seen_texts:
            continue
        seen_texts.add(digest)
        records.append(Record(text, source.lang, f"{package.name}:{installed}", license))
        used += size
        if used >= source.budget:
            break
    return records


def write_jsonl_gz(path: Path, records: list[Record]) -> None:
    """gzip with mtime=0 and no file name in the header, so equal records give equal bytes."""
    buffer = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buffer, compresslevel=9, mtime=0) as gz:
        for record in records:
            gz.write(record.to_json().encode("utf-8") + b"\n")
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(buffer.getvalue())
    tmp.replace(path)


def notice_section(packages: dict[str, Package], taken: dict[str, list[Record]]) -> str:
    lines = [
        NOTICE_BEGIN,
        "",
        "The sample corpus in appliance/data/sample_corpus/*.jsonl.gz is text taken from these Debian 12",
        "(bookworm) packages. Each record names its package and file in `source` and its license in `license`.",
        "Man pages were formatted with groff and HTML pages converted to plain text. Beyond that, the text",
        "was only trimmed: control characters, colour codes and bidi marks removed, the translator-credits",
        "section of manpages-l10n pages and untranslated paragraphs of partial translations left out.",
        "The full terms are in /usr/share/doc/<package>/copyright inside each package.",
        "",
    ]
    for source in SOURCES:
        package = packages[source.package]
        records = taken[source.package]
        if not records:
            continue
        licenses = sorted({r.license for r in records})
        text_bytes = sum(len(r.text.encode("utf-8")) for r in records)
        lines += [
            f"{package.name} {package.version} (Debian source package {package.source_name} {package.source_version})",
            f"  Taken:     {source.what}",
            f"             -> {source.lang}.jsonl.gz: {len(records)} documents, {text_bytes:,} bytes of text",
            f"  License:   {', '.join(licenses)}",
            *([f"  Note:      {source.license_note}"] if source.license_note else []),
            f"  Copyright: {source.holders}",
            "",
        ]
    lines.append(NOTICE_END)
    return "\n".join(lines) + "\n"


def update_notice(path: Path, section: str) -> None:
    """Replace the sample-corpus section of NOTICE, keeping everything around it."""
    old = path.read_text(encoding="utf-8") if path.exists() else "bloom-appliance\n\n"
    if NOTICE_BEGIN in old and NOTICE_END in old:
        head, rest = old.split(NOTICE_BEGIN, 1)
        tail = rest.split(NOTICE_END, 1)[1].lstrip("\n")
        new = head + section + ("\n" + tail if tail else "")
    else:
        new = old.rstrip("\n") + "\n\n" + section
    path.write_text(new, encoding="utf-8")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=HERE, help="where the .jsonl.gz files go (default: here)")
    parser.add_argument("--notice", type=Path, default=REPO_ROOT / "NOTICE", help="NOTICE file to update")
    parser.add_argument("--cache", type=Path, help="keep downloaded .deb files here and reuse them")
    parser.add_argument("--latest", action="store_true", help="take the archive's current versions, not the pins")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    absent = [tool for tool in REQUIRED_TOOLS if shutil.which(tool) is None]
    if absent:
        raise SystemExit(f"rebuild needs {', '.join(absent)} on PATH (Debian packages apt, dpkg, groff-base)")
    with tempfile.TemporaryDirectory(prefix="sample-corpus-") as tmp:
        work = Path(tmp)
        packages = fetch(SOURCES, args.cache or work / "debs", work / "root", args.latest)
        seen_texts: set[str] = set()
        taken: dict[str, list[Record]] = {}
        by_lang: dict[str, list[Record]] = defaultdict(list)
        for source in SOURCES:
            records = select(source, packages[source.package], seen_texts)
            taken[source.package] = records
            by_lang[source.lang].extend(records)
            print(f"{source.package:<22} {source.lang:<4} {len(records):>5} docs", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    for stale in args.out.glob("*.jsonl.gz"):
        if stale.name.removesuffix(".jsonl.gz") not in by_lang:
            stale.unlink()
    for lang, records in sorted(by_lang.items()):
        target = args.out / f"{lang}.jsonl.gz"
        write_jsonl_gz(target, records)
        text_bytes = sum(len(r.text.encode("utf-8")) for r in records)
        print(f"{target.name:<16} {len(records):>5} docs {text_bytes:>10,} text bytes {target.stat().st_size:>10,} gz")
    update_notice(args.notice, notice_section(packages, taken))
    return 0


if __name__ == "__main__":
    sys.exit(main())
