"""Helpers shared by the runtime and the tools: atomic writes and opening images."""

import contextlib
import gzip
import json
import os
import tempfile
from pathlib import Path

from glance_rt.errors import GlanceError


def cache_root() -> Path:
    """glance-rt's cache folder (kernel timings, converted GGUF files): `$GLANCE_RT_CACHE`, else
    `$XDG_CACHE_HOME/glance-rt`, else `~/.cache/glance-rt`. Anything in it can be deleted at any time."""
    root = os.environ.get("GLANCE_RT_CACHE")
    if root is None:
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "glance-rt"
    return Path(root)


def atomic_write(path: Path, write) -> None:
    """`write(tmp_path)` then rename onto `path`: readers see the old file or the complete new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        write(Path(tmp))
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(path, doc) -> None:
    """`doc` as indented JSON at `path`, atomically; gzip-compressed where the name ends in .gz (reports
    kept in docs/ are: `zcat report.json.gz`)."""
    path = Path(path)
    text = json.dumps(doc, indent=2).encode()
    if path.suffix == ".gz":
        text = gzip.compress(text, mtime=0)
    atomic_write(path, lambda p: p.write_bytes(text))


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


JSON_KINDS = {  # kind -> (test, what the message asks for)
    "object": (lambda v: isinstance(v, dict), "an object"),
    "integer": (_is_int, "an integer"),
    "number": (lambda v: _is_int(v) or isinstance(v, float), "a number"),
    "integers": (lambda v: isinstance(v, list) and all(_is_int(i) for i in v), "a list of integers"),
    "boolean": (lambda v: isinstance(v, bool), "true or false"),
    "string": (lambda v: isinstance(v, str), "a string"),
}


def check_json_fields(doc, fields: dict[str, str], what: str) -> None:
    """GlanceError naming the field where `doc` (JSON read from a file: `what`) is not an object, or where a
    field of `fields` (dotted name -> a kind of `JSON_KINDS`) is present with another type, before anything
    reads it (`"hidden_size": "64"`, `"num_attention_heads": 2.5`)."""
    if not isinstance(doc, dict):
        raise GlanceError(f"{what} must be a JSON object, got {type(doc).__name__}")
    for name, kind in fields.items():
        parent, _, key = name.rpartition(".")
        scope = doc.get(parent) if parent else doc
        value = scope.get(key) if isinstance(scope, dict) else None
        test, want = JSON_KINDS[kind]
        if value is not None and not test(value):
            raise GlanceError(f"{what}: {name} must be {want}, got {value!r}; fix that field")


def atomic_remove(path: Path) -> None:
    """Remove a file or folder by renaming it aside (`.NAME.old`), then deleting that: a kill leaves the
    whole thing or a hidden leftover (cleared by the next call), never a half-deleted one that looks complete."""
    import shutil

    def delete(p: Path) -> None:
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()

    path = Path(path)
    old = path.with_name(f".{path.name}.old")
    delete(old)  # a killed call's leftover
    if path.exists():
        os.replace(path, old)
        delete(old)


def atomic_folder(path: Path, write) -> None:
    """`write(tmp_dir)` fills a temp folder beside `path`, then it is renamed into place (an old folder
    moved aside first): an interrupted write never leaves a folder that looks complete."""
    import shutil

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        write(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    os.chmod(tmp, 0o755)  # mkdtemp makes 0700; a model folder is meant to be shared
    for f in tmp.iterdir():
        os.chmod(f, 0o644)
    if path.exists():
        old = path.with_name(f".{path.name}.old")
        os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, path)


@contextlib.contextmanager
def exclusive(path: Path):
    """Hold an exclusive lock on `path`'s lock file (`.NAME.lock` beside it) while the block runs: one process
    at a time builds a shared cache entry, and the others wait, then read it. Yields whether it holds the
    lock: where none can be taken (no `fcntl`, an unwritable folder) the block runs unlocked, and the entry
    is still written atomically."""
    path = Path(path)
    try:
        import fcntl

        path.parent.mkdir(parents=True, exist_ok=True)
        f = open(path.with_name(f".{path.name}.lock"), "a")
    except (ImportError, OSError):
        yield False
        return
    with f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield True
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def clear_leftovers(path: Path) -> list[Path]:
    """Remove the temp and set-aside folders a killed `atomic_folder(path, ...)` left beside `path`
    (`.NAME.*`); call it only while holding `exclusive(path)`, when no live writer can own one. Returns
    what it removed."""
    import shutil

    path = Path(path)
    gone = [p for p in path.parent.glob(f".{path.name}.*") if p.is_dir()] if path.parent.is_dir() else []
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
    return gone


def open_image(path, what: str = "image"):
    """A PIL RGB image, or a GlanceError saying which file could not be opened."""
    from PIL import Image, UnidentifiedImageError

    try:
        return Image.open(path).convert("RGB")
    except (OSError, UnidentifiedImageError) as e:
        raise GlanceError(f"could not open {what} {str(path)!r} ({e}); give a PNG/JPEG file") from e


def open_images(row: dict, images_dir: str | None) -> list:
    """The images of a prompt row (`images`: paths relative to `images_dir`)."""
    return [open_image(Path(images_dir or ".") / name, f"prompt {row.get('id', '?')}'s image")
            for name in row.get("images") or ()]
