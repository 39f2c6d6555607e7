"""Deterministic prompt corpus for training and evaluating drafters.

Five task kinds of decreasing grounding (``KINDS``) are generated from text found on this machine:
Python standard-library sources and docstrings, the package documentation under ``/usr/share/doc``
(READMEs, NEWS, ``copyright`` files, Debian changelogs) and the package records in the dpkg status
database. Variety comes from templates x documents x parameters drawn from a seeded
``random.Random``. The held-out split is chosen per source document (a hash of the document's unit
and the seed), so held-out prompts never share a document with training prompts.

Documentation differs between machines, so the shipped ``data/prompts.jsonl`` is the source of truth
at runtime; ``python scripts/build_corpus.py --out glance_rt/data/prompts.jsonl`` regenerates it (same
bytes for the same seed on the same machine).
"""

from __future__ import annotations

import argparse
import ast
import gzip
import inspect
import json
import keyword
import math
import os
import random
import re
import sys
import sysconfig
import tempfile
import time
import unicodedata
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

from glance_rt.errors import GlanceError
from glance_rt.tools.suites import HELDOUT_FRACTION, KINDS, SPLITS, default_corpus_path, split_of

if TYPE_CHECKING:
    from PIL.Image import Image as PILImage

MAX_PROMPT_CHARS = 1200
MAX_PROMPT_TOKENS = 270  # by approx_tokens(); about 300 real SmolLM2 tokens at worst for most prompts
MAX_DOC_CHARS = 850
MIN_DOC_CHARS = 150
IMAGE_SIZE = (224, 224)

DOC_ROOT = Path("/usr/share/doc")
DPKG_STATUS = Path("/var/lib/dpkg/status")
_STDLIB_SKIP_DIRS = {
    "site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "tkinter", "turtledemo",
    "ensurepip", "pydoc_data", "encodings", "lib-dynload",
}
_MAX_FILE_BYTES = 300_000
_PER_FILE_FUNCTIONS = 16
_PER_FILE_PROSE = 8
_ORDINALS = ("first", "second", "third", "fourth", "fifth", "sixth")
_STOPWORDS = frozenset(
    "about above after again against also because been before being below between both could does doing during "
    "each from further have having here into itself just more most must only other over same should some such "
    "than that their them then there these they this those through under until very were what when where which "
    "while will with would your return none true false self args kwargs".split()
)


_Func = ast.FunctionDef | ast.AsyncFunctionDef


@dataclass
class Doc:
    """One short document: where it came from, its text, and parsed details the templates use."""

    source: str
    kind: str
    text: str
    meta: dict = field(default_factory=dict)
    unit: str = ""  # split key: documents with the same unit always land in the same split

    def __post_init__(self) -> None:
        self.unit = self.unit or self.source


# --------------------------------------------------------------------------- text cleaning

_CTRL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u200b-\u200f\u2028\u2029\ufeff]")
_LICENSE = re.compile(
    r"permission is hereby granted|without any warranty|general public license|redistribution and use|"
    r"licensed under|is free software|all rights reserved|merchantability|warranties|copyright \(c\)|"
    r"spdx-license|free software foundation|the above copyright notice|apache license|"
    r"you may not use this file|copyleft|mozilla public license"
)
_JUNK = re.compile(r"[\x00-\x09\x0b-\x1f\x7f-\x9f\ufffd\u2028\u2029]")
_TOKEN_PIECE = re.compile(r"[A-Za-z]{1,8}|\d|[^\sA-Za-z\d]|\n")
_SENTENCE_END = re.compile(r"[a-z]{2}[.!?]$")
_NON_LETTER = re.compile(r"[\W\d_]+")
_RULE_LINE = re.compile(r"\s*[-=~#*_+|.]{3,}\s*")
_LIST_ITEM = re.compile(r"\s*([-*+•]|\d+[.)])\s")
_NOT_PROSE = (">>>", "::", "```", "{", "}", "==", "|", "$ ", "\\", "--", "@")
_ABBREV = re.compile(r"\b(e\.g|i\.e|etc|vs|cf|Mr|Mrs|Dr|No|approx|incl)\.$", re.I)


def clean_text(text: str) -> str:
    """NFC-normalise, drop control characters, expand tabs, strip trailing spaces, squeeze blank lines."""
    text = unicodedata.normalize("NFC", text).replace("\r\n", "\n").replace("\r", "\n").expandtabs(4)
    text = _CTRL.sub("", text)
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    return re.sub(r"\n{3,}", "\n\n", text).strip("\n")


def is_clean(text: str) -> bool:
    """True for printable text without decoding junk and with few non-ASCII characters."""
    if _JUNK.search(text):
        return False
    non_ascii = len(text) - len(text.encode("ascii", "ignore"))
    return non_ascii == 0 or (non_ascii <= 0.05 * len(text) and all(c.isprintable() or c == "\n" for c in text))


def is_license(text: str) -> bool:
    """True when the text looks like license or copyright boilerplate."""
    return _LICENSE.search(text.lower()) is not None


def reflow(paragraph: str) -> str:
    """Join a paragraph's lines into one line with single spaces."""
    return " ".join(paragraph.split())


def sentences(text: str) -> list[str]:
    """Split prose into sentences (simple rules; keeps common abbreviations together)."""
    parts = re.split(r"(?<=[.!?])\s+(?=[A-Z0-9\"'(`])", reflow(text))
    out: list[str] = []
    for part in parts:
        if out and _ABBREV.search(out[-1]):
            out[-1] += " " + part
        else:
            out.append(part)
    return [s for s in out if s]


def approx_tokens(text: str) -> int:
    """A tokenizer-free token estimate: word pieces of up to 8 letters, single digits and symbols, newlines."""
    return len(_TOKEN_PIECE.findall(text))


def trim_sentences(text: str, limit: int) -> str | None:
    """The longest run of leading sentences that fits in ``limit`` characters (None if none fits)."""
    kept: list[str] = []
    for sent in sentences(text):
        if len(" ".join([*kept, sent])) > limit:
            break
        kept.append(sent)
    return " ".join(kept) or None


def _is_prose(raw: str) -> bool:
    """A paragraph of running text (not code, tables, lists, headings or boilerplate)."""
    if len(raw) < MIN_DOC_CHARS:
        return False
    text = reflow(raw)
    words = text.split()
    if len(words) < 25 or len(text) < MIN_DOC_CHARS or len(text) - len(words) > 9 * len(words):
        return False
    if not _SENTENCE_END.search(text[-20:]) or any(tok in text for tok in _NOT_PROSE):
        return False
    if len(_NON_LETTER.sub("", text)) < 0.75 * (len(text) - len(words) + 1):
        return False
    lines = [ln for ln in raw.split("\n") if ln.strip()]
    if any(_RULE_LINE.fullmatch(ln) for ln in lines) or sum(bool(_LIST_ITEM.match(ln)) for ln in lines) > 1:
        return False
    return not is_license(text) and is_clean(text)


def prose_passages(text: str) -> list[str]:
    """Prose passages of one or two paragraphs, each within the document size limits."""
    paras = []
    for raw in re.split(r"\n\s*\n", clean_text(text)):
        if _is_prose(raw):
            para = trim_sentences(reflow(raw), MAX_DOC_CHARS)
            paras.append(para if para and len(para) >= MIN_DOC_CHARS else None)
        else:
            paras.append(None)
    out = [p for p in paras if p]
    for a, b in zip(paras, paras[1:], strict=False):
        if a and b and len(a) + len(b) + 2 <= MAX_DOC_CHARS:
            out.append(f"{a}\n\n{b}")
    return out


# --------------------------------------------------------------------------- file helpers


def _read_text(path: Path, limit: int = 65_536) -> str | None:
    """The first ``limit`` characters of a (possibly gzip'd) UTF-8 text file, or None if unreadable."""
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rt", encoding="utf-8", errors="replace") as fh:
                return fh.read(limit)
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read(limit)
    except (OSError, EOFError, ValueError):
        return None


def deb822(text: str) -> list[dict[str, str]]:
    """Parse RFC-822-style stanzas (dpkg status, DEP-5 copyright): ``{field: value}``, continuations kept."""
    stanzas: list[dict[str, str]] = []
    current: dict[str, str] = {}
    key = None
    for line in text.split("\n"):
        if not line.strip():
            if current:
                stanzas.append(current)
            current, key = {}, None
        elif line[0] in " \t" and key:
            current[key] += "\n" + line
        elif ":" in line and not line.startswith("#"):
            key, _, value = line.partition(":")
            current[key] = value.strip()
    if current:
        stanzas.append(current)
    return stanzas


# --------------------------------------------------------------------------- stdlib documents


def _stdlib_files() -> Iterator[tuple[str, Path]]:
    """(relative name, path) of standard-library modules worth reading, in sorted order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _STDLIB_SKIP_DIRS and not d.startswith(("_", "config-")))
        for name in sorted(filenames):
            path = Path(dirpath) / name
            if name.endswith(".py") and not name.startswith("test") and path.stat().st_size <= _MAX_FILE_BYTES:
                yield path.relative_to(root).as_posix(), path


def _spread(items: list, k: int) -> list:
    """At most ``k`` items taken evenly across the list."""
    if len(items) <= k:
        return items
    step = len(items) / k
    return [items[int(i * step)] for i in range(k)]


def _function_doc(node: _Func, lines: list[str], source: str, owner: str) -> Doc | None:
    """A Doc for one function or method, or None if it is too long, too short or not clean."""
    start = min([node.lineno] + [d.lineno for d in node.decorator_list])
    pad = node.col_offset
    body = [ln[pad:] if ln[:pad].strip() == "" else ln for ln in lines[start - 1 : node.end_lineno]]
    src = clean_text("\n".join(body))
    src_lines = src.split("\n")
    if not 100 <= len(src) <= MAX_DOC_CHARS or len(src_lines) != len(body) or max(map(len, src_lines)) > 110:
        return None  # (a changed line count would shift the docstring span)
    if not is_clean(src):
        return None
    doc = ast.get_docstring(node) or ""
    first = node.body[0]
    doc_span = None
    if doc and isinstance(first, ast.Expr):
        doc_span = (first.lineno - start, first.end_lineno - start + 1)
    args = node.args
    params = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]
    positional = args.posonlyargs + args.args
    defaults = [None] * (len(positional) - len(args.defaults)) + [ast.unparse(d) for d in args.defaults]
    defaults += [ast.unparse(d) if d is not None else None for d in args.kw_defaults]
    all_args = args.posonlyargs + args.args + args.kwonlyargs + [a for a in (args.vararg, args.kwarg) if a]
    facts = _body_facts(node)
    stored = facts.pop("stored")
    return Doc(
        source=source,
        kind="function",
        text=src,
        meta={
            "name": node.name,
            "qualname": f"{owner}.{node.name}" if owner else node.name,
            "module": source.split(":", 1)[1].removesuffix(".py").removesuffix("/__init__").replace("/", "."),
            "doc": clean_text(doc) if is_clean(doc) else "",
            "doc_span": doc_span,
            "params": list(zip(params, defaults, strict=True)),
            "signature": ast.unparse(args),
            "returns": ast.unparse(node.returns) if node.returns else None,
            "annotated": node.returns is not None or any(a.annotation is not None for a in all_args),
            "is_method": bool(owner),
            **facts,
            "locals": sorted((stored | {a.arg for a in all_args}) - {"self", "cls", "_"}),
        },
    )


def _body_facts(node: _Func) -> dict:
    """One walk over a function: raised exceptions, value returns, self-calls and assigned names."""
    raises, stored = set(), set()
    has_return = recursive = False
    for n in ast.walk(node):
        if isinstance(n, ast.Raise) and n.exc:
            raises.add(_raise_name(n))
        elif isinstance(n, ast.Return) and n.value is not None:
            has_return = True
        elif isinstance(n, ast.Call) and getattr(n.func, "id", None) == node.name:
            recursive = True
        elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            stored.add(n.id)
    return {"raises": sorted(raises), "has_return": has_return, "recursive": recursive, "stored": stored}


def _raise_name(node: ast.Raise) -> str:
    """The exception class name in a ``raise`` statement."""
    exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
    return ast.unparse(exc)


def _signature_docs(tree: ast.Module, source: str) -> list[Doc]:
    """Groups of 3-5 public top-level function signatures from one module."""
    sigs = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
            ret = f" -> {ast.unparse(node.returns)}" if node.returns else ""
            line = f"def {node.name}({ast.unparse(node.args)}){ret}"
            if len(line) <= 100:
                sigs.append((node.name, line))
    out = []
    for i in range(0, len(sigs) - 2, 5):
        group = sigs[i : i + 5]
        if len(group) >= 3:
            text = "\n".join(s[1] for s in group)
            out.append(Doc(source, "signatures", text, {"names": [s[0] for s in group]}))
    return out


def _constant_docs(tree: ast.Module, lines: list[str], source: str) -> list[Doc]:
    """Runs of 3-8 consecutive ``NAME = literal`` module constants, verbatim."""
    out, run = [], []

    def flush() -> None:
        if len(run) >= 3:
            text = "\n".join(r[1] for r in run[:8])
            out.append(Doc(source, "constants", text, {"names": [r[0] for r in run[:8]]}))
        run.clear()

    for node in tree.body:
        ok = (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
            and node.targets[0].id.isupper()
            and node.lineno == node.end_lineno
            and _is_literal(node.value)
        )
        line = lines[node.lineno - 1] if ok else ""
        if ok and len(line) <= 100 and is_clean(line):
            run.append((node.targets[0].id, line.rstrip()))
        else:
            flush()
    flush()
    return out


def _is_literal(node: ast.AST) -> bool:
    """True for constants, negative numbers and tuples/lists of them."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, (str, int, float, bool))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return _is_literal(node.operand)
    return isinstance(node, (ast.Tuple, ast.List)) and 0 < len(node.elts) <= 6 and all(map(_is_literal, node.elts))


def _docstring_prose(tree: ast.Module, source: str) -> list[Doc]:
    """Prose passages from a module's docstring and its functions' and classes' docstrings."""
    out = []
    kinds = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    nodes = [tree] + [n for n in tree.body if isinstance(n, kinds)]
    nodes += [m for n in nodes if isinstance(n, ast.ClassDef) for m in n.body if isinstance(m, kinds)]
    for node in nodes:
        doc = ast.get_docstring(node, clean=False)
        if doc and len(doc) >= MIN_DOC_CHARS:
            out += [Doc(source, "prose", p) for p in prose_passages(inspect.cleandoc(doc))]
    return _spread(out, _PER_FILE_PROSE)


def _functions(tree: ast.Module) -> list[tuple[_Func, str]]:
    """(function, owning class name or "") for top-level functions and methods of 3-40 lines, dunders skipped."""
    out = []
    for node in tree.body:
        owned = [(n, node.name) for n in node.body] if isinstance(node, ast.ClassDef) else [(node, "")]
        for fn, owner in owned:
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and not fn.name.startswith("__"):
                if 3 <= fn.end_lineno - fn.lineno + 1 <= 40:
                    out.append((fn, owner))
    return out


def stdlib_docs() -> list[Doc]:
    """Functions, signatures, constants and docstring prose from the Python standard library."""
    docs: list[Doc] = []
    for rel, path in _stdlib_files():
        text = _read_text(path, _MAX_FILE_BYTES)
        try:
            tree = ast.parse(text or "")
        except (SyntaxError, ValueError):
            continue
        source = f"stdlib:{rel}"
        lines = text.split("\n")
        candidates = _spread(_functions(tree), 2 * _PER_FILE_FUNCTIONS)
        funcs = [_function_doc(fn, lines, source, owner) for fn, owner in candidates]
        docs += _spread([f for f in funcs if f], _PER_FILE_FUNCTIONS)
        docs += _signature_docs(tree, source) + _constant_docs(tree, lines, source) + _docstring_prose(tree, source)
    return docs


# --------------------------------------------------------------------------- package documentation

_COPYRIGHT_HEAD = ("Upstream-Name", "Upstream-Contact", "Source")
_CL_HEAD = re.compile(r"^(\S+) \(([^)\s]+)\) ([^;]+); *urgency=(\w+)")
_CL_SIGN = re.compile(r"^ -- (.+?) <([^>]+)>  (.+)$")
_PROSE_FILE = re.compile(r"^(README|NEWS|FAQ|TODO|THANKS|AUTHORS|USAGE)[^/]*$|\.(txt|md|rst)(\.gz)?$", re.I)


def changelog_entries(text: str, limit: int | None = None) -> list[dict]:
    """The first ``limit`` (default all) entries of a Debian changelog.

    Each entry has package, version, distribution, urgency, changes, author, email, date and text.
    """
    entries, cur = [], None
    for line in text.split("\n"):
        if limit is not None and len(entries) >= limit:
            break
        head = _CL_HEAD.match(line)
        if head:
            cur = dict(zip(("package", "version", "distribution", "urgency"), head.groups(), strict=True), lines=[line])
            continue
        if cur is None:
            continue
        cur["lines"].append(line)
        sign = _CL_SIGN.match(line)
        if sign:
            cur.update(author=sign[1], email=sign[2], date=sign[3], text=clean_text("\n".join(cur.pop("lines"))))
            cur["changes"] = _changelog_changes(cur["text"])
            entries.append(cur)
            cur = None
    return entries


def _changelog_changes(text: str) -> list[str]:
    """The ``*`` bullet items of a changelog entry, each reflowed to one line."""
    changes: list[str] = []
    for line in text.split("\n")[1:]:
        if line.startswith("  * "):
            changes.append(line[4:].strip())
        elif line.startswith("    ") and changes:
            changes[-1] += " " + line.strip()
    return changes


def _changelog_docs(path: Path, source: str) -> list[Doc]:
    """Short, clean entries (at most three) of a Debian changelog."""
    out = []
    for entry in changelog_entries(clean_text(_read_text(path, 8_000) or ""), limit=3):
        if MIN_DOC_CHARS <= len(entry["text"]) <= MAX_DOC_CHARS and entry["changes"] and is_clean(entry["text"]):
            out.append(Doc(source, "changelog", entry["text"], entry))
    return out


def _copyright_doc(path: Path, source: str) -> Doc | None:
    """The header and first ``Files`` stanzas of a machine-readable (DEP-5) copyright file, license texts dropped."""
    stanzas = deb822(clean_text(_read_text(path) or ""))
    if not stanzas or "Format" not in stanzas[0]:
        return None
    head = {k: _short_value(v, 1) for k, v in stanzas[0].items() if k in _COPYRIGHT_HEAD}
    lines = [f"{k}: {v}" for k, v in head.items()]
    files = []
    for st in stanzas[1:]:
        if "Files" not in st or "Copyright" not in st or "License" not in st:
            continue
        item = {"files": reflow(st["Files"]), "copyright": _short_value(st["Copyright"]),
                "license": st["License"].split("\n")[0]}
        block = [f"Files: {item['files']}", f"Copyright: {item['copyright']}", f"License: {item['license']}"]
        if len("\n".join(lines + block)) + 2 > MAX_DOC_CHARS or len(files) == 5:
            break
        lines += [""] + block if lines else block
        files.append(item)
    text = "\n".join(lines).strip()
    if not files or len(text) < 80 or not is_clean(text):
        return None
    return Doc(source, "copyright", text, {"header": head, "files": files})


def _short_value(value: str, max_lines: int = 3) -> str:
    """A deb822 value kept to its first lines, continuation lines indented by one space."""
    parts = [p.strip() for p in value.split("\n") if p.strip() and p.strip() != "."][:max_lines]
    return "\n ".join(parts)


def package_doc_docs(root: Path = DOC_ROOT) -> list[Doc]:
    """Prose, changelog entries and copyright headers from ``/usr/share/doc`` (symlinked duplicates skipped)."""
    docs: list[Doc] = []
    if not root.is_dir():
        return docs
    seen: set[str] = set()
    for name in sorted(os.listdir(root)):
        real = os.path.realpath(root / name)
        if real in seen or not os.path.isdir(real):
            continue
        seen.add(real)
        pkg = os.path.basename(real)
        for fname in sorted(os.listdir(real)):
            path = Path(real) / fname
            if not path.is_file():
                continue
            source = f"doc:{pkg}/{fname}"
            if fname == "copyright":
                docs += [d for d in [_copyright_doc(path, source)] if d]
            elif fname == "changelog.Debian.gz":
                docs += _changelog_docs(path, source)
            elif _PROSE_FILE.search(fname) and path.stat().st_size <= 400_000:
                passages = _spread(prose_passages(_read_text(path) or ""), _PER_FILE_PROSE)
                docs += [Doc(source, "prose", p) for p in passages]
    return docs


# --------------------------------------------------------------------------- dpkg records

_RECORD_FIELDS = ("Package", "Version", "Architecture", "Maintainer", "Installed-Size", "Section", "Priority",
                  "Depends", "Homepage")


def dpkg_docs(path: Path = DPKG_STATUS) -> list[Doc]:
    """Installed-package records, 3-record groups and description prose from the dpkg status file."""
    text = _read_text(path, 50_000_000) if path.is_file() else None
    records = [_record(st) for st in deb822(clean_text(text or "")) if "installed" in st.get("Status", "")]
    records = sorted((r for r in records if r), key=lambda r: r["fields"]["Package"])
    docs: list[Doc] = []
    for i in range(0, len(records), 3):
        group = records[i : i + 3]
        unit = "dpkg-group:" + group[0]["fields"]["Package"]
        for rec in group:
            source = "dpkg:" + rec["fields"]["Package"]
            docs.append(Doc(source, "record", rec["text"], rec, unit))
            docs += [Doc(source, "prose", p, unit=unit) for p in prose_passages(rec["long"])[:1]]
        if len(group) == 3:
            docs.append(_group_doc(group, unit))
    return docs


def _record(stanza: dict[str, str]) -> dict | None:
    """A package record: selected fields, short and long description, rendered text."""
    fields = {k: stanza[k] for k in _RECORD_FIELDS if k in stanza and "\n" not in stanza[k]}
    if "Package" not in fields or "Version" not in fields or len(fields.get("Depends", "")) > 250:
        return None
    desc = stanza.get("Description", "")
    short, _, long = desc.partition("\n")
    long_lines = [ln.strip() for ln in long.split("\n")]
    long_text = "\n".join("" if ln == "." else ln for ln in long_lines).strip()
    lines = [f"{k}: {v}" for k, v in fields.items()] + [f"Description: {short.strip()}"]
    body = trim_sentences(reflow(long_text.split("\n\n")[0]), 360) if long_text else None
    text = "\n".join(lines + ([" " + body] if body else []))
    if len(text) > MAX_DOC_CHARS or not is_clean(text):
        return None
    return {"fields": fields, "short": short.strip(), "long": long_text, "body": body or "", "text": text}


def _group_doc(group: list[dict], unit: str) -> Doc:
    """Three compact package records as one document."""
    keys = ("Package", "Version", "Architecture", "Installed-Size", "Section")
    rows = [{k: r["fields"].get(k, "") for k in keys} for r in group]
    text = "\n\n".join("\n".join(f"{k}: {v}" for k, v in row.items() if v) for row in rows)
    source = "dpkg:" + "+".join(r["Package"] for r in rows)
    return Doc(source, "records", text, {"rows": rows}, unit)


# --------------------------------------------------------------------------- synthetic subjects (code tasks, chat)

_TASKS = (  # (function name, task template, template parameters)
    ("top_words", "returns the {k} most frequent words in a text, ignoring case", {"k": (3, 5, 10)}),
    ("is_palindrome", "checks whether a string is a palindrome, ignoring {x}",
     {"x": ("case", "spaces and punctuation", "accents")}),
    ("convert_temp", "converts a temperature from {a} to {b}",
     {"a": ("Celsius", "Fahrenheit", "Kelvin"), "b": ("Celsius", "Fahrenheit", "Kelvin")}),
    ("dedupe", "removes duplicates from a {seq} while keeping the original order",
     {"seq": ("list", "tuple", "string")}),
    ("merge_sorted", "merges {n} sorted lists into one sorted list without calling sorted()",
     {"n": ("two", "any number of")}),
    ("fibonacci", "returns the n-th Fibonacci number using {m}",
     {"m": ("a loop", "memoization", "matrix exponentiation")}),
    ("chunks", "splits a list into chunks of size {n}, the last chunk possibly shorter", {"n": ("n", "3", "100")}),
    ("count_vowels", "counts the {what} in a string",
     {"what": ("vowels", "consonants", "digits", "uppercase letters")}),
    ("parse_pairs", "parses a string of key=value pairs separated by {sep} into a dict",
     {"sep": ("commas", "semicolons", "newlines")}),
    ("file_stats", "reads a text file and returns the number of {u} in it",
     {"u": ("lines", "words", "non-empty lines")}),
    ("stats", "computes the {s} of a list of numbers without the statistics module",
     {"s": ("mean", "median", "mode", "variance", "standard deviation")}),
    ("flatten", "flattens a nested list {d}",
     {"d": ("of arbitrary depth", "by exactly one level", "up to a given depth")}),
    ("primes", "returns all prime numbers below {n} using the sieve of Eratosthenes",
     {"n": ("n", "a limit given as argument")}),
    ("fmt_seconds", "formats a number of seconds as {f}",
     {"f": ("HH:MM:SS", "'1h 2m 3s'", "a human-readable phrase like '2 hours, 5 minutes'")}),
    ("common_prefix", "finds the longest common {p} of a list of strings", {"p": ("prefix", "suffix")}),
    ("rotate", "rotates a list by k positions to the {d}", {"d": ("left", "right")}),
    ("group_by", "groups a list of dicts by the value of a given key and returns a dict of lists", {}),
    ("binary_search", "performs binary search on a sorted list and returns {r}",
     {"r": ("the index or -1", "the insertion point", "True or False")}),
    ("matrix", "{op} two matrices given as lists of lists", {"op": ("multiplies", "adds", "transposes one of")}),
    ("word_wrap", "wraps text to lines of at most {w} characters without breaking words", {"w": (40, 60, 80)}),
    ("roman", "converts {a}", {"a": ("an integer to a Roman numeral", "a Roman numeral to an integer")}),
    ("anagrams", "groups a list of words into lists of anagrams", {}),
    ("valid_parens", "checks whether the brackets in a string are balanced ({b})", {"b": ("(), [] and {}", "only ()")}),
    ("run_length", "{op} a string with run-length encoding", {"op": ("encodes", "decodes")}),
    ("caesar", "applies a Caesar cipher with shift k to a string, keeping {keep} unchanged",
     {"keep": ("non-letters", "case")}),
)
_CODE_EXTRAS = ("", " Include a docstring.", " Add type hints.", " Keep it short and readable.",
                " Explain your solution in two sentences after the code.", " Also give two example calls.")

_TOPICS = (
    "gardening", "baking bread", "learning the guitar", "running a first marathon", "saving money", "public speaking",
    "learning a new language", "keeping houseplants alive", "camping in the rain", "moving to a new city",
    "starting a podcast", "birdwatching", "journaling", "making friends as an adult", "cooking for one",
    "studying for exams", "working from home", "training a puppy", "planning a wedding", "writing a novel",
    "recycling at home", "learning to swim", "taking better photos", "staying focused", "going on a first date",
    "hosting a dinner party", "painting with watercolors", "fixing a bicycle", "decluttering a room",
    "getting better sleep", "learning chess", "volunteering", "starting to meditate", "visiting a museum",
)
_CONCEPTS = (
    "photosynthesis", "gravity", "inflation", "the water cycle", "black holes", "vaccines", "compound interest",
    "the internet", "evolution", "democracy", "electricity", "plate tectonics", "the immune system", "rainbows",
    "climate change", "recursion", "supply and demand", "the moon's phases", "DNA", "encryption", "tides",
    "volcanoes", "machine learning", "the stock market", "time zones", "sound waves", "magnetism", "seasons",
)
_AUDIENCES = ("a five-year-old", "a high-school student", "my grandmother", "a busy manager", "a curious teenager",
              "someone who has never heard of it")
_NAMES = ("Mara", "Tobias", "Ines", "Kofi", "Lena", "Arjun", "Yuki", "Omar", "Sofia", "Finn", "Priya", "Mateo",
          "Hana", "Elias", "Zara", "Nils", "Amara", "Jonah", "Leila", "Oscar")
_ROLES = ("a lighthouse keeper", "a retired astronaut", "a young baker", "a shy robot", "a street musician",
          "a stubborn goat", "a time-travelling librarian", "a detective cat", "a lonely dragon", "a clockmaker",
          "a marine biologist", "a night-shift nurse", "a village postman", "a curious fox", "an apprentice wizard")
_SETTINGS = ("a snowy mountain village", "a floating market", "an abandoned space station", "a busy train station",
             "a rainforest", "a tiny island", "a haunted bookstore", "a desert oasis", "the bottom of the sea",
             "a city where it never stops raining", "a medieval castle", "a school for inventors")
_EVENTS = ("finds a mysterious map", "loses their voice before a big show", "receives a letter from the future",
           "befriends an unlikely companion", "has to solve a puzzle to get home", "discovers a hidden door",
           "must keep a promise", "wins a prize by accident", "gets lost during a storm", "learns a secret")
_THINGS = ("autumn leaves", "the ocean", "a cup of coffee", "city lights", "an old bicycle", "the first snow",
           "a thunderstorm", "a lost sock", "morning fog", "a library at night", "a train window", "the moon")
_STYLES = ("a haiku", "a limerick", "a short rhyming poem", "free verse", "a sonnet", "a four-line poem")
_FEELINGS = ("nervous", "overwhelmed", "excited but unsure", "stuck", "frustrated", "unmotivated")
_SITUATIONS = ("starting a new job", "a difficult conversation with a friend", "choosing a university",
               "asking for a raise", "living with a messy roommate", "changing careers", "a big exam next week",
               "learning to code", "moving abroad", "speaking up in meetings")
_PAIRS = (("a virus", "a bacterium"), ("weather", "climate"), ("a lake", "a pond"), ("baking soda", "baking powder"),
          ("a crocodile", "an alligator"), ("RAM", "storage"), ("a comet", "an asteroid"), ("tea", "coffee"),
          ("a violin", "a viola"), ("a republic", "a democracy"), ("jam", "jelly"), ("a moth", "a butterfly"),
          ("speed", "velocity"), ("a hurricane", "a tornado"), ("a fruit", "a vegetable"))
_OCCASIONS = ("a rainy Sunday", "a birthday party for a ten-year-old", "a team-building day", "a picnic",
              "a first trip abroad", "a family game night", "a long train ride", "a quiet evening at home")
_PLACES = ("Lisbon", "Kyoto", "the Scottish Highlands", "Cape Town", "Montreal", "Iceland", "Vienna", "Patagonia",
           "Istanbul", "New Zealand")
_WHAT_IFS = ("humans could breathe underwater", "the moon disappeared", "everyone could read minds",
             "cats could talk", "it never got dark", "money did not exist", "we could photosynthesise",
             "the internet went down for a month", "trees could walk", "gravity were half as strong")


def task_docs() -> list[Doc]:
    """Synthetic 'write a function that ...' tasks: template x parameter, one split unit each."""
    docs = []
    for name, template, params in _TASKS:
        keys = list(params)
        combos = [dict(zip(keys, vals, strict=True)) for vals in _product(*(params[k] for k in keys))]
        for combo in combos:
            if combo.get("a") is not None and combo.get("a") == combo.get("b"):
                continue
            text = template.format(**combo)
            docs.append(Doc("", "task", text, {"fname": name, "task": text}, unit=f"task:{text}"))
    return docs


def _product(*pools: Iterable) -> list[tuple]:
    """Cartesian product as a list (empty input gives one empty tuple)."""
    out: list[tuple] = [()]
    for pool in pools:
        out = [(*prefix, item) for prefix in out for item in pool]
    return out


def chat_docs() -> list[Doc]:
    """Chat subjects: each primary subject is one split unit; templates add secondary details."""
    subjects = (
        [("topic", t) for t in _TOPICS] + [("concept", c) for c in _CONCEPTS] + [("character", n) for n in _NAMES]
        + [("thing", t) for t in _THINGS] + [("situation", s) for s in _SITUATIONS]
        + [("pair", f"{a}|{b}") for a, b in _PAIRS] + [("occasion", o) for o in _OCCASIONS]
        + [("place", p) for p in _PLACES] + [("whatif", w) for w in _WHAT_IFS]
    )
    return [Doc("", f"chat_{k}", v, {"value": v}, unit=f"chat:{k}:{v}") for k, v in subjects]


# --------------------------------------------------------------------------- templates

Template = Callable[[Doc, random.Random], "str | None"]
_TEMPLATES: dict[str, list[tuple[tuple[str, ...], Template, float]]] = {k: [] for k in KINDS}


def _template(kind: str, *doc_kinds: str, weight: float = 1.0) -> Callable[[Template], Template]:
    """Register a prompt template for a task kind over the given document kinds, drawn with ``weight``."""

    def register(fn: Template) -> Template:
        _TEMPLATES[kind].append((doc_kinds, fn, weight))
        return fn

    return register


def _layout(rng: random.Random, instruction: str, body: str, label: str = "Text", lang: str | None = None) -> str:
    """Put the instruction before or after the document, with varied delimiters."""
    if lang is not None:
        body = f"```{lang}\n{body}\n```"
    style = rng.randrange(3)
    if style == 0:
        return f"{instruction}\n\n{body}"
    if style == 1:
        return f"{label}:\n{body}\n\n{instruction}"
    return f'{instruction}\n\n"""\n{body}\n"""' if lang is None else f"{instruction}\n\n{body}"


def _doc_noun(doc: Doc) -> str:
    """How prompts refer to a document of this kind."""
    return {"function": "function", "changelog": "changelog entry", "record": "package record",
            "records": "package records", "copyright": "copyright file", "constants": "code",
            "signatures": "list of signatures"}.get(doc.kind, "text")


def _label(doc: Doc) -> str:
    """A label for the document in 'Label: ... Question' layouts."""
    return _doc_noun(doc).capitalize()


def _lang(doc: Doc) -> str | None:
    """Fence language for code documents (None for plain text)."""
    return "python" if doc.kind in ("function", "constants", "signatures") else None


def _words(text: str, min_len: int = 5) -> list[str]:
    """Distinct lowercase alphabetic words of at least ``min_len`` letters, not stopwords, in order."""
    seen: dict[str, None] = {}
    for w in re.findall(r"[A-Za-z]+", text):
        if len(w) >= min_len and w.lower() not in _STOPWORDS:
            seen.setdefault(w.lower())
    return list(seen)


def _unique_line_token(doc: Doc, rng: random.Random) -> tuple[str, str] | None:
    """A token (and its line) that appears in exactly one line of the document."""
    lines = [ln for ln in doc.text.split("\n") if ln.strip()]
    counts: dict[str, int] = {}
    where: dict[str, str] = {}
    for ln in lines:
        for tok in set(re.findall(r"\b[A-Za-z_][A-Za-z0-9_]{3,}\b", ln)):
            counts[tok] = counts.get(tok, 0) + 1
            where[tok] = ln
    good = sorted(t for t, c in counts.items() if c == 1 and t.lower() not in _STOPWORDS and not keyword.iskeyword(t))
    if not good:
        return None
    tok = rng.choice(good)
    return tok, where[tok]


# ---- extraction


@_template("extraction", "prose", weight=2)
def _ex_copy(doc: Doc, rng: random.Random) -> str:
    intro = rng.choice((
        "Copy the following paragraph exactly:", "Repeat this text word for word:",
        "Reproduce the passage below verbatim, without changing anything.",
        "Please copy out the following text exactly as written.",
        "Transcribe this text exactly, keeping every word and punctuation mark.",
    ))
    return _layout(rng, intro, doc.text)


@_template("extraction", "prose", weight=2)
def _ex_nth_sentence(doc: Doc, rng: random.Random) -> str | None:
    sents = sentences(doc.text)
    if not 2 <= len(sents) <= len(_ORDINALS):
        return None
    idx = rng.randrange(len(sents))
    which = "last" if idx == len(sents) - 1 and rng.random() < 0.5 else _ORDINALS[idx]
    verb = rng.choice(("Repeat", "Copy", "Quote", "Write out"))
    return _layout(rng, f"{verb} the {which} sentence of the following text verbatim.", doc.text)


@_template("extraction", "prose")
def _ex_nth_paragraph(doc: Doc, rng: random.Random) -> str | None:
    paras = doc.text.split("\n\n")
    if len(paras) < 2:
        return None
    which = rng.choice(_ORDINALS[: len(paras)])
    return _layout(rng, f"Copy the {which} paragraph of the text below exactly, and nothing else.", doc.text)


@_template("extraction", "prose")
def _ex_sentences_with_word(doc: Doc, rng: random.Random) -> str | None:
    sents = sentences(doc.text)
    words = [w for w in _words(doc.text, 5) if 1 <= sum(bool(re.search(rf"\b{w}\b", s, re.I)) for s in sents) <= 2]
    if len(sents) < 2 or not words:
        return None
    word = rng.choice(words)
    return _layout(rng, f'Copy every sentence from the text that contains the word "{word}", exactly as written.',
                   doc.text)


@_template("extraction", "prose")
def _ex_first_words(doc: Doc, rng: random.Random) -> str | None:
    n_words = len(doc.text.split())
    if n_words < 20:
        return None
    n = rng.randrange(8, min(n_words - 5, 40))
    return _layout(rng, f"Write out the first {n} words of this text exactly.", doc.text)


@_template("extraction", "function", weight=2)
def _ex_docstring(doc: Doc, rng: random.Random) -> str | None:
    if not doc.meta["doc"]:
        return None
    name = doc.meta["qualname"]
    intro = rng.choice((f"Transcribe the docstring of `{name}` exactly, without the surrounding quotes.",
                        f"Copy the documentation string of `{name}` verbatim.",
                        f"What is the docstring of `{name}`? Reproduce it exactly."))
    return _layout(rng, intro, doc.text, "Code", "python")


@_template("extraction", "function", "changelog", "record", "copyright", "constants", weight=2)
def _ex_quote_line(doc: Doc, rng: random.Random) -> str | None:
    found = _unique_line_token(doc, rng)
    if not found:
        return None
    tok = found[0]
    intro = rng.choice((f"Quote the line that mentions `{tok}` in the {_doc_noun(doc)} below, exactly as it appears.",
                        f"Which line of this {_doc_noun(doc)} contains `{tok}`? Copy that line verbatim.",
                        f"Find the line with `{tok}` and copy it exactly."))
    return _layout(rng, intro, doc.text, _label(doc), _lang(doc))


@_template("extraction", "function", weight=0.7)
def _ex_returns(doc: Doc, rng: random.Random) -> str | None:
    if not doc.meta["has_return"]:
        return None
    return _layout(rng, "Copy every `return` statement in this function exactly, one per line.", doc.text, "Code",
                   "python")


@_template("extraction", "changelog")
def _ex_bullets(doc: Doc, rng: random.Random) -> str:
    intro = rng.choice(("List every change (the items starting with '*') in this changelog entry verbatim.",
                        "Copy the bullet points of this changelog entry exactly as written.",
                        "Extract the first change listed in this changelog entry, word for word."))
    return _layout(rng, intro, doc.text, "Changelog")


@_template("extraction", "changelog", weight=0.7)
def _ex_signoff(doc: Doc, rng: random.Random) -> str:
    intro = rng.choice(('Copy the sign-off line (the one starting with " -- ") of this changelog entry exactly.',
                        "Copy the first line of this changelog entry exactly."))
    return _layout(rng, intro, doc.text, "Changelog")


@_template("extraction", "changelog", "copyright", "record", weight=0.7)
def _ex_emails(doc: Doc, rng: random.Random) -> str | None:
    if "@" not in doc.text:
        return None
    return _layout(rng, "Extract every email address in the text below exactly as written, one per line.",
                   doc.text, _label(doc))


@_template("extraction", "record", weight=0.8)
def _ex_field(doc: Doc, rng: random.Random) -> str | None:
    fields = [k for k in ("Version", "Maintainer", "Installed-Size", "Section", "Depends", "Architecture", "Homepage")
              if k in doc.meta["fields"]]
    if not fields:
        return None
    name = rng.choice(fields)
    return _layout(rng, f"What is the exact value of the `{name}` field in this package record? "
                        "Reply with the value only, copied verbatim.", doc.text, "Record")


@_template("extraction", "copyright", weight=0.8)
def _ex_copyright_holder(doc: Doc, rng: random.Random) -> str:
    item = rng.choice(doc.meta["files"])
    return _layout(rng, f"Quote exactly the Copyright entry for the files `{item['files']}` in this copyright file.",
                   doc.text, "Copyright file")


@_template("extraction", "signatures", weight=0.7)
def _ex_signature(doc: Doc, rng: random.Random) -> str:
    name = rng.choice(doc.meta["names"])
    return _layout(rng, f"Copy the signature of `{name}` from this list exactly.", doc.text, "Signatures", "python")


# ---- conversion

_JSON_EXTRAS = ("", " Output only the JSON.", " Use lowercase keys with underscores.",
                " Make numbers JSON numbers, not strings.")


def _join(items: list[str]) -> str:
    """`a`, `b` and `c` (items quoted as code)."""
    quoted = [f"`{item}`" for item in items]
    return ", ".join(quoted[:-1]) + f" and {quoted[-1]}" if len(quoted) > 1 else quoted[0]


def _keys(names: Iterable[str]) -> str:
    """A human list of snake_case keys: `a`, `b` and `c`."""
    return _join([n.lower().replace("-", "_") for n in names])


@_template("conversion", "record")
def _cv_record_json(doc: Doc, rng: random.Random) -> str:
    names = [k for k in doc.meta["fields"] if k != "Maintainer" or rng.random() < 0.5]
    extra = " Turn `depends` into a list of package names." if "Depends" in names and rng.random() < 0.5 else ""
    return _layout(rng, f"Convert this package record to a JSON object with the keys {_keys(names)}.{extra}"
                        f"{rng.choice(_JSON_EXTRAS)}", doc.text, "Record")


@_template("conversion", "record")
def _cv_record_table(doc: Doc, rng: random.Random) -> str:
    intro = rng.choice(("Turn this package record into a markdown table with two columns, Field and Value.",
                        "Rewrite this package record as a bulleted list, one field per bullet, as `- Field: value`.",
                        "Convert this package record into CSV with a header row `field,value`."))
    return _layout(rng, intro + rng.choice(("", " Leave out the Description.", " Keep the Description short.")),
                   doc.text, "Record")


@_template("conversion", "records")
def _cv_records(doc: Doc, rng: random.Random) -> str:
    cols = [k for k in doc.meta["rows"][0] if all(r[k] for r in doc.meta["rows"])]
    fmt = rng.choice((f"CSV with the header `{','.join(c.lower().replace('-', '_') for c in cols)}`",
                      f"a markdown table with the columns {', '.join(cols)}",
                      f"a JSON array of objects with the keys {_keys(cols)}",
                      "a bulleted list with one package per bullet, giving its name, version and size"))
    return _layout(rng, f"Convert these package records to {fmt}.", doc.text, "Records")


@_template("conversion", "records")
def _cv_csv(doc: Doc, rng: random.Random) -> str:
    rows = doc.meta["rows"]
    cols = [k for k in rows[0] if all(r[k] for r in rows)]
    csv = "\n".join([",".join(c.lower() for c in cols)] + [",".join(r[c] for c in cols) for r in rows])
    fmt = rng.choice(("a markdown table", "a JSON array of objects", "a bulleted list, one row per bullet",
                      "a JSON object keyed by package name"))
    return _layout(rng, f"Convert this CSV data into {fmt}.", csv, "CSV")


@_template("conversion", "changelog")
def _cv_changelog(doc: Doc, rng: random.Random) -> str:
    intro = rng.choice((
        "Convert this changelog entry to JSON with the keys `package`, `version`, `distribution`, `urgency`, "
        "`author`, `date` and `changes` (a list of strings).",
        "Rewrite this changelog entry as markdown: a heading with the package and version, a bulleted list of the "
        "changes, then the author and date in italics.",
        "Turn this changelog entry into a markdown table with one row per change and the columns Change and Closes "
        "(the bug number, or empty).",
        "Convert this changelog entry into a YAML document with the keys version, author, date and changes.",
    ))
    return _layout(rng, intro, doc.text, "Changelog")


@_template("conversion", "function", weight=1.5)
def _cv_signature(doc: Doc, rng: random.Random) -> str | None:
    if not doc.meta["params"]:
        return None
    name = doc.meta["qualname"]
    intro = rng.choice((
        f'Describe the signature of `{name}` as JSON: {{"name": ..., "parameters": [{{"name": ..., "default": ...}}], '
        '"returns": ...}. Use null where there is no default or annotation.',
        f"Make a markdown table of the parameters of `{name}` with the columns Parameter, Default and Meaning.",
        f"List the parameters of `{name}` as a bulleted list in the form `- name (default): short description`.",
    ))
    return _layout(rng, intro, doc.text, "Code", "python")


@_template("conversion", "signatures")
def _cv_signatures(doc: Doc, rng: random.Random) -> str:
    fmt = rng.choice(("a markdown table with the columns Function, Parameters and Return type",
                      'a JSON array of objects like {"name": ..., "parameters": [...]}',
                      "CSV with the header `function,parameter_count,parameters`",
                      "a bulleted list, one function per bullet, with its parameters in parentheses"))
    return _layout(rng, f"Convert these Python function signatures into {fmt}.", doc.text, "Signatures", "python")


@_template("conversion", "constants", weight=0.5)
def _cv_constants(doc: Doc, rng: random.Random) -> str:
    fmt = rng.choice(("a single JSON object mapping each name to its value",
                      "a markdown table with the columns Name, Value and Type",
                      "CSV with the header `name,value`", "a YAML mapping",
                      "a bulleted list in the form `- NAME = value`"))
    return _layout(rng, f"Convert these constant definitions into {fmt}.", doc.text, "Code", "python")


@_template("conversion", "prose", weight=1.5)
def _cv_prose(doc: Doc, rng: random.Random) -> str:
    intro = rng.choice((
        "Rewrite the following paragraph as a bulleted list with one point per sentence.",
        'Turn this text into JSON with the keys "topic" (a short phrase) and "points" (a list of its main points).',
        "Convert this text into a markdown table with the columns Term and What the text says about it.",
        "Restructure the text below as a numbered list of its key facts.",
    ))
    return _layout(rng, intro, doc.text)


@_template("conversion", "copyright")
def _cv_copyright(doc: Doc, rng: random.Random) -> str:
    fmt = rng.choice(("a JSON array of objects with the keys `files`, `copyright` and `license`",
                      "a markdown table with the columns Files, Copyright and License",
                      "CSV with the header `files,copyright,license`",
                      "a JSON object that maps each license name to the list of file patterns it covers"))
    return _layout(rng, f"Convert the Files sections of this copyright file into {fmt}.", doc.text, "Copyright file")


# ---- grounded question answering and summaries

_ANSWER_STYLE = ("", " Answer using only the document.", " Answer in one sentence.", " Be brief.")


def _qa(rng: random.Random, question: str, doc: Doc) -> str:
    """A question about a document, asked before or after it."""
    return _layout(rng, f"{question}{rng.choice(_ANSWER_STYLE)}", doc.text, _label(doc), _lang(doc))


@_template("grounded_qa", "record")
def _qa_record(doc: Doc, rng: random.Random) -> str:
    f = doc.meta["fields"]
    pkg = f["Package"]
    qs = [f"According to this record, which version of {pkg} is installed?",
          f"Summarise what {pkg} does in one sentence, based only on its description.",
          f"Who maintains {pkg}, and how can they be contacted?",
          f"Is {pkg} architecture-independent? Explain using the record."]
    if "Depends" in f:
        qs += [f"Which packages does {pkg} depend on?", f"How many packages does {pkg} depend on directly?"]
    if "Installed-Size" in f:
        qs.append(f"How much disk space does {pkg} use once installed, in megabytes?")
    return _qa(rng, rng.choice(qs), doc)


@_template("grounded_qa", "records")
def _qa_records(doc: Doc, rng: random.Random) -> str:
    q = rng.choice(("Which of these packages has the largest installed size?",
                    "Which of these packages are architecture-independent (Architecture: all)?",
                    "List the packages in order of installed size, smallest first.",
                    "What is the total installed size of these packages?",
                    "Which sections do these packages belong to?"))
    return _qa(rng, q, doc)


@_template("grounded_qa", "changelog")
def _qa_changelog(doc: Doc, rng: random.Random) -> str:
    qs = ["Who signed off this changelog entry, and on what date?",
          "Which version does this changelog entry describe, and for which distribution?",
          f"How many changes are listed in this entry for {doc.meta['package']}?",
          "Summarise the changes in this entry in two sentences.",
          "What is the urgency of this upload, and what does that suggest?",
          "Explain in plain words what the first change in this entry does."]
    if "Closes" in doc.text:
        qs.append("Which bug numbers does this entry close?")
    return _qa(rng, rng.choice(qs), doc)


@_template("grounded_qa", "function", weight=1.5)
def _qa_function(doc: Doc, rng: random.Random) -> str:
    m = doc.meta
    name = m["qualname"]
    qs = [f"Explain in plain English what `{name}` does.", f"What are the parameters of `{name}`?",
          f"Summarise the behaviour of `{name}` in two sentences.",
          f"Walk through what happens, step by step, when `{name}` is called."]
    if m["has_return"]:
        qs.append(f"What does `{name}` return?")
    if m["raises"]:
        qs.append(f"Which exceptions can `{name}` raise, and when?")
    defaults = [p for p, d in m["params"] if d is not None]
    if defaults:
        qs.append(f"What is the default value of the parameter `{rng.choice(defaults)}`, and what does it control?")
    return _qa(rng, rng.choice(qs), doc)


@_template("grounded_qa", "prose", weight=1.5)
def _qa_prose(doc: Doc, rng: random.Random) -> str:
    n = rng.choice(("one sentence", "two sentences", "at most 30 words", "three bullet points"))
    qs = [f"Summarise the following text in {n}.", "Give this passage a short, descriptive title.",
          "What is the main point of this passage?", "Explain this passage to a beginner in two or three sentences.",
          "Write two questions that this text answers, each with a short answer.",
          "List the technical terms that appear in the text and say briefly what each means here."]
    words = _words(doc.text, 6)
    if words:
        w = rng.choice(words)
        qs.append(f'What does the text say about "{w}"?')
    return _qa(rng, rng.choice(qs), doc)


@_template("grounded_qa", "copyright")
def _qa_copyright(doc: Doc, rng: random.Random) -> str:
    item = rng.choice(doc.meta["files"])
    qs = [f"Which license covers the files matching `{item['files']}`?",
          f"Who holds the copyright for `{item['files']}`?",
          "How many different licenses are mentioned in this copyright file? Name them.",
          "Summarise the licensing of this package in one or two sentences."]
    if doc.meta["header"]:
        qs.append("What is the upstream name or source of this software, according to the file?")
    return _qa(rng, rng.choice(qs), doc)


@_template("grounded_qa", "signatures", weight=0.7)
def _qa_signatures(doc: Doc, rng: random.Random) -> str:
    name = rng.choice(doc.meta["names"])
    q = rng.choice((f"How many parameters does `{name}` take, and which ones are optional?",
                    "Which of these functions take no arguments at all?",
                    "Which function has the most parameters?",
                    f"Based only on its name and signature, what do you think `{name}` does?"))
    return _qa(rng, q, doc)


# ---- code


def _code_prompt(rng: random.Random, instruction: str, code: str) -> str:
    """An instruction with a fenced Python block, instruction first or last."""
    fenced = f"```python\n{code}\n```"
    return f"{instruction}\n\n{fenced}" if rng.random() < 0.7 else f"{fenced}\n\n{instruction}"


def _without_docstring(doc: Doc) -> str:
    """The function's source with its docstring removed."""
    span = doc.meta["doc_span"]
    lines = doc.text.split("\n")
    if span:
        lines = lines[: span[0]] + lines[span[1] :]
    return "\n".join(lines)


@_template("code", "function", weight=2)
def _cd_type_hints(doc: Doc, rng: random.Random) -> str | None:
    if doc.meta["annotated"] or not [p for p, _ in doc.meta["params"] if p not in ("self", "cls")]:
        return None
    intro = rng.choice(("Add type hints to this function.",
                        "Add type annotations to the parameters and the return value of this function. "
                        "Keep the behaviour unchanged.",
                        "Annotate this function with precise type hints and return the full code."))
    return _code_prompt(rng, intro, doc.text)


@_template("code", "function", weight=2)
def _cd_rename(doc: Doc, rng: random.Random) -> str | None:
    names = [n for n in doc.meta["locals"] if re.search(rf"\b{n}\b", doc.text)]
    if not names:
        return None
    old = rng.choice(names)
    pool = ("value", "result", "item", "total", "count", "index", "buf", "current", "entry", "target", "output",
            "record", "chunk", "position", "element", "token", "limit", "offset", f"{old}_value", f"new_{old}")
    new = rng.choice([p for p in pool if not re.search(rf"\b{p}\b", doc.text)] or [f"{old}_renamed"])
    intro = rng.choice((f"Rename the variable `{old}` to `{new}` in the following code.",
                        f"In this function, rename `{old}` to `{new}` everywhere it is used and return the full code."))
    return _code_prompt(rng, intro, doc.text)


@_template("code", "function", weight=2.5)
def _cd_from_docstring(doc: Doc, rng: random.Random) -> str | None:
    m = doc.meta
    desc = trim_sentences(m["doc"].split("\n\n")[0], 400) if m["doc"] else None
    if not desc or len(desc) < 30:
        return None
    params = [p for p, _ in m["params"] if p not in ("self", "cls")]
    sig = m["signature"].removeprefix("self, ").removeprefix("self").removeprefix("cls, ").removeprefix("cls")
    ret = f" -> {m['returns']}" if m["returns"] else ""
    extra = rng.choice(("", "Include a docstring.", "Use only the standard library.", ""))
    head = rng.choice((f"Write a Python function `{m['name']}({sig}){ret}` that does the following:",
                       f"Implement `{m['name']}` in Python. {_takes(params)} Specification:"))
    return "\n\n".join(part for part in (head, desc, extra) if part)


def _takes(params: list[str]) -> str:
    """'It takes no parameters.' / 'It takes the parameters `a` and `b`.'"""
    return f"It takes the parameters {_join(params)}." if params else "It takes no parameters."


_MUTATIONS = ((" == ", " != "), (" != ", " == "), (" < ", " <= "), (" > ", " >= "), (" <= ", " < "),
              (" >= ", " > "), (" + 1", " - 1"), (" - 1", " + 1"), ("return True", "return False"),
              ("return False", "return True"), (" and ", " or "), (" or ", " and "), (" is None", " is not None"),
              (" is not None", " is None"), ("[0]", "[1]"), ("[1:]", "[2:]"), (" not in ", " in "))


def mutate(doc: Doc, rng: random.Random) -> str | None:
    """The function's source with one small bug planted outside its docstring, strings and comments."""
    lines = doc.text.split("\n")
    span = doc.meta["doc_span"] or (0, 0)
    spots = [(i, a, b) for i, ln in enumerate(lines) if not span[0] <= i < span[1] and not re.search(r"['\"#]", ln)
             for a, b in _MUTATIONS if a in ln]
    if not spots:
        return None
    i, a, b = rng.choice(spots)
    lines[i] = lines[i].replace(a, b, 1)
    return "\n".join(lines)


@_template("code", "function", weight=3)
def _cd_fix_bug(doc: Doc, rng: random.Random) -> str | None:
    buggy = mutate(doc, rng)
    if buggy is None:
        return None
    intro = rng.choice(("Fix the bug in this function.", "This function contains one bug. Find it and return the "
                        "corrected code.", "Something is wrong in the following code. Fix it and explain the fix in "
                        "one sentence.", "Find the logic error in this function and correct it."))
    return _code_prompt(rng, intro, buggy)


@_template("code", "function", weight=2)
def _cd_edit(doc: Doc, rng: random.Random) -> str:
    name = doc.meta["qualname"]
    intro = rng.choice((
        "Write a concise docstring for this function.", f"Write pytest unit tests for `{name}`.",
        "Refactor this function for readability without changing its behaviour.",
        f"Translate this Python function into {rng.choice(('JavaScript', 'Go', 'Rust', 'TypeScript', 'Java'))}.",
        "Add comments explaining each step of this function.",
        "Add input validation that raises ValueError for invalid arguments.",
    ))
    code = _without_docstring(doc) if intro.startswith("Write a concise docstring") else doc.text
    return _code_prompt(rng, intro, code)


@_template("code", "function")
def _cd_recursive(doc: Doc, rng: random.Random) -> str | None:
    if not doc.meta["recursive"]:
        return None
    return _code_prompt(rng, "Rewrite this recursive function iteratively, keeping its behaviour.", doc.text)


@_template("code", "constants", weight=0.4)
def _cd_enum(doc: Doc, rng: random.Random) -> str:
    intro = rng.choice(("Rewrite these module-level constants as an `enum.Enum` class.",
                        "Group these constants into a frozen dataclass with the same values.",
                        "Write a function that returns the name of the constant below that matches a given value."))
    return _code_prompt(rng, intro, doc.text)


@_template("code", "signatures", weight=0.6)
def _cd_stubs(doc: Doc, rng: random.Random) -> str:
    intro = rng.choice(("Write a `typing.Protocol` class with methods matching these function signatures.",
                        "Add type hints to these signatures and write one-line docstrings for them.",
                        "Write a short usage example that calls each of these functions."))
    return _code_prompt(rng, intro, doc.text)


@_template("code", "task", weight=1.2)
def _cd_task(doc: Doc, rng: random.Random) -> str:
    head = rng.choice((f"Write a Python function `{doc.meta['fname']}` that", "Write a Python function that",
                       "Implement a function in Python that", "Write Python code that"))
    return f"{head} {doc.meta['task']}.{rng.choice(_CODE_EXTRAS)}"


# ---- chat

_CONTEXTS = ("I'm a nurse who works night shifts.", "I'm a retired teacher with lots of free time.",
             "I'm a student on a tight budget.", "I have two young kids.", "I'm new to this, so keep it simple.",
             "I live in a small apartment in a big city.", "English is my second language.",
             "I only have about ten minutes a day.", "I'm seventy and curious about everything.",
             "My friends say I overthink things.", "I'm a software developer who wants a break from screens.")
_CHAT_SUFFIXES = (" Keep it under 150 words.", " Use simple language.", " Please make it fun.",
                  " Answer in a friendly tone.", " Use a numbered list.", " Be honest and practical.")


def _chat(rng: random.Random, prompt: str, context: bool = False) -> str:
    """A chat prompt with sometimes a style request and (where ``context``) a line about the asker."""
    if context and rng.random() < 0.4:
        prompt = f"{rng.choice(_CONTEXTS)} {prompt}"
    if rng.random() < 0.3:
        prompt += rng.choice(_CHAT_SUFFIXES)
    return prompt


@_template("chat", "chat_topic")
def _ch_topic(doc: Doc, rng: random.Random) -> str:
    t = doc.meta["value"]
    return _chat(rng, rng.choice((
        f"What are some good tips for {t}?", f"I want to get into {t}. Where should I start?",
        f"What mistakes do beginners often make with {t}?",
        f"Give me a simple {rng.choice((3, 5, 7))}-step plan for {t}.",
        f"Write a short, encouraging note to a friend who is new to {t}.",
    )), context=True)


@_template("chat", "chat_concept")
def _ch_concept(doc: Doc, rng: random.Random) -> str:
    c = doc.meta["value"]
    return _chat(rng, rng.choice((
        f"Explain {c} to {rng.choice(_AUDIENCES)}.", f"How does {c} work?", f"Why is {c} important? Keep it short.",
        f"Tell me three surprising facts about {c}.", f"Write a short analogy that explains {c}.",
    )))


@_template("chat", "chat_character")
def _ch_story(doc: Doc, rng: random.Random) -> str:
    name, role = doc.meta["value"], rng.choice(_ROLES)
    setting, event = rng.choice(_SETTINGS), rng.choice(_EVENTS)
    return _chat(rng, rng.choice((
        f"Write a short story about {name}, {role} who {event} in {setting}.",
        f"Tell me a bedtime story about {name}, {role}, set in {setting}.",
        f"Continue this story: {name} was {role} in {setting}, and one morning {name} {event}.",
        f"Write the opening scene of a story in which {name}, {role}, {event}.",
        f"Describe a day in the life of {name}, {role} living in {setting}.",
    )))


@_template("chat", "chat_thing")
def _ch_poem(doc: Doc, rng: random.Random) -> str:
    t = doc.meta["value"]
    return _chat(rng, rng.choice((
        f"Write {rng.choice(_STYLES)} about {t}.", f"Describe {t} using all five senses.",
        f"Write a few sentences about {t} from the point of view of {rng.choice(_ROLES)}.",
    )))


@_template("chat", "chat_situation")
def _ch_advice(doc: Doc, rng: random.Random) -> str:
    s = doc.meta["value"]
    return _chat(rng, rng.choice((
        f"I'm feeling {rng.choice(_FEELINGS)} about {s}. Any advice?", f"How can I prepare for {s}?",
        f"My friend is dealing with {s}. How can I support them?", f"Give me a pep talk about {s}.",
    )), context=True)


@_template("chat", "chat_pair")
def _ch_compare(doc: Doc, rng: random.Random) -> str:
    a, b = doc.meta["value"].split("|")
    return _chat(rng, rng.choice((
        f"What's the difference between {a} and {b}?", f"Compare {a} and {b} in a few sentences.",
        f"Is {a} the same thing as {b}? Explain simply.",
        f"Explain the difference between {a} and {b} to {rng.choice(_AUDIENCES)}.",
    )))


@_template("chat", "chat_occasion")
def _ch_ideas(doc: Doc, rng: random.Random) -> str:
    o = doc.meta["value"]
    return _chat(rng, rng.choice((
        f"Give me {rng.choice(('three', 'five', 'a few'))} ideas for {o}.", f"What could I cook for {o}?",
        f"Suggest some games or activities for {o}.", f"Write a short invitation for {o}.",
    )), context=True)


@_template("chat", "chat_place")
def _ch_travel(doc: Doc, rng: random.Random) -> str:
    p = doc.meta["value"]
    return _chat(rng, rng.choice((
        f"Plan a {rng.choice((2, 3, 4, 5))}-day trip to {p}.", f"What should I pack for a trip to {p}?",
        f"What is {p} famous for?", f"Write a short postcard message from {p}.",
        f"Recommend things to do in {p} for someone who likes {rng.choice(_TOPICS)}.",
    )), context=True)


@_template("chat", "chat_whatif")
def _ch_whatif(doc: Doc, rng: random.Random) -> str:
    w = doc.meta["value"]
    return _chat(rng, rng.choice((
        f"What would happen if {w}?", f"Write a short story set in a world where {w}.",
        f"Imagine {w}. How would daily life change?", f"Argue for and against: what if {w}?",
    )))


# --------------------------------------------------------------------------- building


@lru_cache(maxsize=1)
def collect_docs() -> tuple[Doc, ...]:
    """Every document found on this machine plus the synthetic subjects, de-duplicated by text."""
    docs = stdlib_docs() + package_doc_docs() + dpkg_docs() + task_docs() + chat_docs()
    seen: set[str] = set()
    out = []
    for doc in docs:
        if doc.text not in seen and is_clean(doc.text):
            seen.add(doc.text)
            out.append(doc)
    return tuple(out)


def heldout_count(per_kind: int) -> int:
    """Held-out prompts per kind: HELDOUT_FRACTION of ``per_kind``, at least one."""
    return max(1, math.ceil(per_kind * HELDOUT_FRACTION))


def _fits(prompt: str) -> bool:
    """True when a prompt is within the character and (estimated) token limits."""
    return len(prompt) <= MAX_PROMPT_CHARS and approx_tokens(prompt) <= MAX_PROMPT_TOKENS


def _generate(kind: str, split: str, n: int, pools: dict[str, list[Doc]], seed: int, seen: set[str]) -> list[dict]:
    """``n`` distinct prompts of one kind and split, cycling through the kind's templates."""
    rng = random.Random(f"glance-corpus:{seed}:{kind}:{split}")
    templates = [(fn, [d for dk in dks for d in pools.get(dk, ())], w) for dks, fn, w in _TEMPLATES[kind]]
    templates = [t for t in templates if t[1]]
    weights = [t[2] for t in templates]
    rows: list[dict] = []
    attempts = 0
    while templates and len(rows) < n and attempts < 60 * n:
        attempts += 1
        fn, pool, _ = rng.choices(templates, weights)[0]
        doc = pool[rng.randrange(len(pool))]
        prompt = fn(doc, rng)
        if prompt is None or prompt in seen or not _fits(prompt):
            continue
        seen.add(prompt)
        rows.append({"kind": kind, "split": split, "prompt": prompt, "source": doc.source})
    if len(rows) < n:
        raise GlanceError(f"corpus: only {len(rows)} of {n} {split} prompts of kind {kind!r} could be made from the "
                          "documents on this machine; lower per_kind or use the shipped prompts.jsonl")
    return rows


def build_corpus(seed: int = 0, per_kind: int = 500) -> list[dict]:
    """``per_kind`` prompts for each kind in ``KINDS`` (about 15% held out by source document)."""
    if per_kind < 2:
        raise GlanceError(f"corpus: per_kind must be at least 2 (got {per_kind})")
    by_split: dict[str, dict[str, list[Doc]]] = {s: {} for s in SPLITS}
    for doc in collect_docs():
        by_split[split_of(f"glance-corpus:{seed}:{doc.unit}")].setdefault(doc.kind, []).append(doc)
    rows: list[dict] = []
    seen: set[str] = set()
    for kind in KINDS:
        n_held = heldout_count(per_kind)
        kind_rows = _generate(kind, "train", per_kind - n_held, by_split["train"], seed, seen)
        kind_rows += _generate(kind, "heldout", n_held, by_split["heldout"], seed, seen)
        rows += [{"id": f"{kind}-{i:05d}", **row} for i, row in enumerate(kind_rows, 1)]
    return rows


# --------------------------------------------------------------------------- files


def write_corpus(path: str | os.PathLike, rows: Iterable[dict]) -> Path:
    """Write rows as JSONL atomically (temp file in the same folder, then ``os.replace``); gzip-compressed
    (with no timestamp, so the same rows give the same bytes) when the name ends in .gz."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        data = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows).encode("utf-8")
        with os.fdopen(fd, "wb") as fh:
            fh.write(gzip.compress(data, mtime=0) if path.suffix == ".gz" else data)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; a shipped data file should be world-readable
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


# --------------------------------------------------------------------------- image prompts

_IMG_ADJS = ("quiet", "silver", "yellow", "little", "ancient", "bright", "copper", "violet", "sleepy", "brave",
             "tiny", "old", "green", "clever", "gentle")
_IMG_NOUNS = ("river", "lantern", "garden", "window", "market", "forest", "bridge", "cloud", "harbor", "candle",
              "meadow", "ticket", "island", "engine", "baker", "sailor", "fox", "teacher", "kite", "train")
_IMG_VERBS = ("crosses", "follows", "hides", "carries", "finds", "paints", "watches", "opens", "builds", "remembers")
_IMG_ITEMS = ("apples", "pens", "cups", "books", "lamps", "chairs", "plums", "maps", "bells", "kites", "boxes")
_IMG_COLORS = ((220, 60, 60), (60, 120, 220), (40, 160, 80), (230, 160, 30), (140, 70, 180), (30, 30, 30))


def _img_sentence(rng: random.Random) -> str:
    """A short synthetic sentence for rendered-text images."""
    (a1, a2), (n1, n2) = rng.sample(_IMG_ADJS, 2), rng.sample(_IMG_NOUNS, 2)
    return f"The {a1} {n1} {rng.choice(_IMG_VERBS)} the {a2} {n2}."


def _wrap(text: str, font, width: int) -> list[str]:
    """Greedy word wrap to a pixel width."""
    lines: list[str] = []
    for word in text.split():
        trial = f"{lines[-1]} {word}" if lines else word
        if lines and font.getlength(trial) <= width:
            lines[-1] = trial
        else:
            lines.append(word)
    return lines


def _img_text(rng: random.Random, draw, font) -> tuple[str, str, str]:
    """A rendered paragraph (extraction)."""
    text = " ".join(_img_sentence(rng) for _ in range(rng.randint(2, 4)))
    for i, line in enumerate(_wrap(text, font, IMAGE_SIZE[0] - 20)[:11]):
        draw.text((10, 12 + 19 * i), line, fill=(0, 0, 0), font=font)
    prompt = rng.choice(("Transcribe the text in the image.", "Copy the text shown in the image exactly.",
                         "What does the text in the image say? Reproduce it verbatim."))
    return "extraction", prompt, "text"


def _img_table(rng: random.Random, draw, font) -> tuple[str, str, str]:
    """A small rendered table (conversion)."""
    header = ("item", "qty", "price")
    rows = [(it, str(rng.randint(1, 20)), f"{rng.randint(1, 99)}.{rng.randint(0, 99):02d}")
            for it in rng.sample(_IMG_ITEMS, rng.randint(2, 4))]
    x0, y0, cw, rh = 12, 20, 66, 28
    for r, cells in enumerate([header, *rows]):
        for c, cell in enumerate(cells):
            draw.rectangle((x0 + c * cw, y0 + r * rh, x0 + (c + 1) * cw, y0 + (r + 1) * rh), outline=(0, 0, 0))
            draw.text((x0 + c * cw + 6, y0 + r * rh + 6), cell, fill=(0, 0, 0), font=font)
    prompt = rng.choice(("Convert the table in the image to JSON.", "Convert the table in the image to CSV.",
                         "Turn the table in the image into a JSON array of objects, one per row."))
    return "conversion", prompt, "table"


def _img_bars(rng: random.Random, draw, font) -> tuple[str, str, str]:
    """A bar chart with distinct heights (grounded_qa)."""
    labels = rng.sample(("A", "B", "C", "D", "E", "F"), rng.randint(3, 5))
    heights = rng.sample(range(20, 160, 10), len(labels))
    base, width = 190, (IMAGE_SIZE[0] - 40) // len(labels)
    draw.line((15, base, IMAGE_SIZE[0] - 15, base), fill=(0, 0, 0))
    for i, (lab, h) in enumerate(zip(labels, heights, strict=True)):
        x = 20 + i * width
        draw.rectangle((x + 6, base - h, x + width - 6, base), fill=rng.choice(_IMG_COLORS))
        draw.text((x + width // 2 - 3, base + 6), lab, fill=(0, 0, 0), font=font)
    prompt = rng.choice(("Which bar is tallest?", "Which bar is shortest?", "List the bars from tallest to shortest.",
                         "Which label has the tallest bar in the chart?"))
    return "grounded_qa", prompt, "bar_chart"


def _img_shapes(rng: random.Random, draw, font) -> tuple[str, str, str]:
    """Circles, squares and triangles on a grid (grounded_qa counting)."""
    cells = rng.sample(range(16), rng.randint(3, 9))
    for cell in cells:
        x, y = 12 + (cell % 4) * 52, 12 + (cell // 4) * 52
        shape, color = rng.choice(("circle", "square", "triangle")), rng.choice(_IMG_COLORS)
        if shape == "circle":
            draw.ellipse((x, y, x + 40, y + 40), fill=color)
        elif shape == "square":
            draw.rectangle((x, y, x + 40, y + 40), fill=color)
        else:
            draw.polygon([(x + 20, y), (x + 40, y + 40), (x, y + 40)], fill=color)
    what = rng.choice(("circles", "squares", "triangles", "shapes"))
    prompt = rng.choice((f"How many {what} are in the image?", f"Count the {what} in the picture."))
    return "grounded_qa", prompt, "shapes"


def make_image_prompts(n: int, seed: int = 0) -> list[tuple[dict, PILImage]]:
    """``n`` (row, PIL image) pairs cycling through rendered text, tables, bar charts and shapes.

    Images are IMAGE_SIZE RGB renders using PIL's default font; about one in seven groups of four is held out.
    """
    from PIL import Image, ImageDraw, ImageFont

    try:
        font = ImageFont.load_default(size=14)  # Pillow >= 10.1 with FreeType: a legible size
    except (TypeError, ImportError, OSError):
        font = ImageFont.load_default()
    rng = random.Random(f"glance-images:{seed}")
    makers = (_img_text, _img_table, _img_bars, _img_shapes)
    out = []
    for i in range(n):
        image = Image.new("RGB", IMAGE_SIZE, (255, 255, 255))
        kind, prompt, what = makers[i % len(makers)](rng, ImageDraw.Draw(image), font)
        split = "heldout" if (i // len(makers)) % 7 == 6 else "train"
        out.append(({"id": f"image-{i:05d}", "kind": kind, "split": split, "prompt": prompt,
                     "source": f"render:{what}"}, image))
    return out


def save_image_prompts(n: int, image_dir: str | os.PathLike, seed: int = 0) -> list[dict]:
    """`make_image_prompts` saved for training a VLM drafter: PNGs in `image_dir`, rows whose
    `images` hold the file names (relative to `image_dir`, as `glance-rt train --images` expects)."""
    image_dir = Path(image_dir)
    image_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for row, image in make_image_prompts(n, seed):
        name = f"{row['id']}.png"
        image.save(image_dir / name)
        rows.append({**row, "images": [name]})
    return rows


# --------------------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> int:
    """Build the corpus and write it as JSONL; prints counts and timing to stderr."""
    ap = argparse.ArgumentParser(prog="python scripts/build_corpus.py", description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(default_corpus_path()), help="output JSONL path")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--per-kind", type=int, default=500, help="prompts per kind (train + held-out)")
    ap.add_argument("--images", type=int, default=0, help="also add N rendered-image prompts (for VLM targets)")
    ap.add_argument("--image-dir", default=None, help="where the rendered images go (with --images)")
    args = ap.parse_args(argv)
    if args.images and not args.image_dir:
        ap.error("--images needs --image-dir")
    start = time.perf_counter()
    try:
        rows = build_corpus(seed=args.seed, per_kind=args.per_kind)
    except GlanceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.images:
        rows += save_image_prompts(args.images, args.image_dir, args.seed)
    path = write_corpus(args.out, rows)
    for kind in KINDS:
        counts = {s: sum(r["kind"] == kind and r["split"] == s for r in rows) for s in SPLITS}
        print(f"{kind:12s} train={counts['train']} heldout={counts['heldout']}", file=sys.stderr)
    print(f"wrote {len(rows)} prompts to {path} ({path.stat().st_size} bytes) in {time.perf_counter() - start:.1f}s",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
