"""The project checkout: where pins, patches, overlay and kernels live, and where outputs go."""
from __future__ import annotations

import fnmatch
import hashlib
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from .errors import UsageError
from .pins import Lock, Pin, load_lock

KERNELS_DEST = "vllm/v1/attention/ops"
# Files at the top of overlay/ that describe the overlay instead of being placed into vLLM.
OVERLAY_META = {"verify.toml", "CONCERNS.toml", "README.md", ".gitkeep"}
_SKIP_DIRS = {"__pycache__", ".pytest_cache", ".mypy_cache"}
_SKIP_SUFFIXES = (".pyc", ".pyo")


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def default_cache_dir() -> Path:
    env = os.environ.get("GLM5_OVERLAY_WHEELS")
    if env:
        return Path(env).expanduser()
    return Path("~/.cache/glm5-overlay/wheels").expanduser()


@dataclass(frozen=True)
class OverlayFile:
    source: str  # path relative to the project root (overlay/vllm/..., kernels/X.py)
    dest: str  # path inside the vLLM tree (vllm/...)
    sha256: str
    mode: int  # git mode: 0o100644 or 0o100755
    path: Path  # absolute path of the source file


@dataclass
class Project:
    root: Path
    lock_path: Path | None = None
    _lock: Lock | None = field(default=None, repr=False)

    @property
    def lock(self) -> Lock:
        if self._lock is None:
            self._lock = load_lock(self.lock_path or self.root / "pins.lock")
        return self._lock

    def pin(self, version: str | None) -> Pin:
        return self.lock.get(version)

    def patches_dir(self, pin: Pin) -> Path:
        return self.root / "patches" / pin.version

    @property
    def overlay_dir(self) -> Path:
        return self.root / "overlay"

    @property
    def kernels_dir(self) -> Path:
        return self.root / "kernels"

    @property
    def kernel_tests_dir(self) -> Path:
        return self.root / "tests" / "kernels"

    def out_dir(self, pin: Pin) -> Path:
        """Reports and built wheels for a pin (git-ignored)."""
        return self.root / "work" / pin.version

    def default_tree(self, pin: Pin) -> Path:
        return self.root / "work" / pin.version / "tree"

    def default_venv(self, pin: Pin) -> Path:
        return self.root / f".venv-vllm-{pin.version}"

    # ---------------------------------------------------------------- overlay
    def overlay_files(self) -> list[OverlayFile]:
        """Every file that goes into the vLLM tree, with its destination.

        overlay/vllm/** lands at vllm/**; kernels/X.py lands at vllm/v1/attention/ops/X.py.
        Raises UsageError on anything that cannot be placed unambiguously.
        """
        files: list[OverlayFile] = []
        if self.overlay_dir.is_dir():
            for entry in sorted(self.overlay_dir.iterdir()):
                if entry.name == "vllm" and entry.is_dir():
                    continue
                if entry.name in OVERLAY_META and entry.is_file():
                    continue
                if entry.name in _SKIP_DIRS:
                    continue
                raise UsageError(
                    f"overlay/{entry.name}: only overlay/vllm/... is placed into the vLLM tree "
                    f"(and {', '.join(sorted(OVERLAY_META))} describe it); move or remove this entry"
                )
            for path in _walk(self.overlay_dir / "vllm"):
                rel = path.relative_to(self.overlay_dir).as_posix()
                files.append(self._file(path, rel))
        if self.kernels_dir.is_dir():
            for entry in sorted(self.kernels_dir.iterdir()):
                if entry.name in _SKIP_DIRS or entry.name.endswith(_SKIP_SUFFIXES):
                    continue
                if entry.name in {"README.md", ".gitkeep"}:
                    continue
                if entry.is_dir() or not entry.name.endswith(".py"):
                    raise UsageError(
                        f"kernels/{entry.name}: kernels/ holds flat X.py files only "
                        f"(each lands at {KERNELS_DEST}/X.py)"
                    )
                if entry.name == "__init__.py":
                    raise UsageError(f"kernels/__init__.py would replace {KERNELS_DEST}/__init__.py; remove it")
                files.append(self._file(entry, f"{KERNELS_DEST}/{entry.name}"))
        seen: dict[str, str] = {}
        for f in files:
            if f.dest in seen:
                raise UsageError(f"{f.source} and {seen[f.dest]} both land at {f.dest}")
            seen[f.dest] = f.source
        return files

    def _file(self, path: Path, dest: str) -> OverlayFile:
        if path.is_symlink():
            raise UsageError(f"{path.relative_to(self.root)}: symbolic links are not placed into the tree")
        source = path.relative_to(self.root).as_posix()
        mode = 0o100755 if os.access(path, os.X_OK) else 0o100644
        return OverlayFile(source, dest, sha256_file(path), mode, path.resolve())

    # ------------------------------------------------------------ verify.toml
    def verify_spec(self) -> "VerifySpec | None":
        path = self.overlay_dir / "verify.toml"
        if not path.is_file():
            return None
        return parse_verify_toml(path)

    # ---------------------------------------------------------- CONCERNS.toml
    def concerns_spec(self) -> "ConcernsSpec | None":
        path = self.overlay_dir / "CONCERNS.toml"
        if not path.is_file():
            return None
        return parse_concerns_toml(path)


def _walk(top: Path):
    if not top.is_dir():
        return
    for dirpath, dirnames, filenames in os.walk(top):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for name in sorted(filenames):
            if name.endswith(_SKIP_SUFFIXES):
                continue
            yield Path(dirpath) / name


# ------------------------------------------------------------------ verify.toml
@dataclass(frozen=True)
class ImportCheck:
    module: str
    gpu: bool = False


@dataclass(frozen=True)
class AttributeCheck:
    object: str  # "module:qualname"
    name: str
    value: str | None = None
    gpu: bool = False


@dataclass(frozen=True)
class VerifySpec:
    path: Path
    imports: tuple[ImportCheck, ...]
    attributes: tuple[AttributeCheck, ...]
    pins: tuple[str, ...] | None = None  # None: applies to every pin

    def to_json(self) -> dict:
        return {
            "imports": [{"module": i.module, "gpu": i.gpu} for i in self.imports],
            "attributes": [
                {"object": a.object, "name": a.name, "value": a.value, "gpu": a.gpu} for a in self.attributes
            ],
        }


def _load_toml(path: Path) -> dict:
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise UsageError(f"{path}: not valid TOML: {e}") from None


def _check_keys(where: str, table: dict, required: set[str], optional: set[str]) -> None:
    if not isinstance(table, dict):
        raise UsageError(f"{where}: must be a table")
    missing = required - set(table)
    if missing:
        raise UsageError(f"{where}: missing {', '.join(sorted(missing))}")
    extra = set(table) - required - optional
    if extra:
        raise UsageError(f"{where}: unknown keys {', '.join(sorted(extra))} (allowed: {', '.join(sorted(required | optional))})")


def _dotted(where: str, value, what: str) -> str:
    if not isinstance(value, str) or not value or not all(p.isidentifier() for p in value.split(".")):
        raise UsageError(f"{where}: {what} {value!r} is not a dotted Python name")
    return value


def parse_verify_toml(path: Path) -> VerifySpec:
    data = _load_toml(path)
    _check_keys(str(path), data, set(), {"import", "attribute", "pins"})
    pins = data.get("pins")
    if pins is not None and (not isinstance(pins, list) or not all(isinstance(p, str) for p in pins)):
        raise UsageError(f"{path}: pins must be a list of versions")
    imports = []
    for i, t in enumerate(data.get("import", [])):
        where = f"{path}: [[import]] #{i + 1}"
        _check_keys(where, t, {"module"}, {"gpu"})
        gpu = t.get("gpu", False)
        if not isinstance(gpu, bool):
            raise UsageError(f"{where}: gpu must be true or false")
        imports.append(ImportCheck(_dotted(where, t["module"], "module"), gpu))
    attrs = []
    for i, t in enumerate(data.get("attribute", [])):
        where = f"{path}: [[attribute]] #{i + 1}"
        _check_keys(where, t, {"object", "name"}, {"value", "gpu"})
        obj = t["object"]
        if not isinstance(obj, str) or obj.count(":") != 1:
            raise UsageError(f"{where}: object {obj!r} must be 'package.module:Name' (module, a colon, then the object)")
        mod, qual = obj.split(":")
        _dotted(where, mod, "module")
        _dotted(where, qual, "object name")
        name = t["name"]
        if not isinstance(name, str) or not name.isidentifier():
            raise UsageError(f"{where}: name {name!r} is not an identifier")
        value = t.get("value")
        if value is not None and not isinstance(value, str):
            raise UsageError(f"{where}: value must be a string")
        gpu = t.get("gpu", False)
        if not isinstance(gpu, bool):
            raise UsageError(f"{where}: gpu must be true or false")
        attrs.append(AttributeCheck(obj, name, value, gpu))
    return VerifySpec(path, tuple(imports), tuple(attrs), tuple(pins) if pins is not None else None)


# ---------------------------------------------------------------- CONCERNS.toml
@dataclass(frozen=True)
class Concern:
    name: str
    paths: tuple[str, ...]  # project-relative globs (overlay/vllm/..., kernels/...)
    title: str | None = None
    description: str | None = None
    tests: tuple[tuple[str, str], ...] = ()  # (project test file, its path in vLLM's tree)
    not_carried: tuple[tuple[str, str], ...] = ()  # (project test file, why it stays home)
    results: tuple[dict, ...] = ()  # measured results PR.md quotes (see docs/CONVENTIONS.md)


RESULT_KINDS = ("pytest", "records")


@dataclass(frozen=True)
class ConcernsSpec:
    path: Path
    concerns: dict[str, Concern]

    def concern_of(self, source: str) -> list[str]:
        return [c.name for c in self.concerns.values() if any(fnmatch.fnmatchcase(source, g) for g in c.paths)]


def valid_concern_name(name: str) -> bool:
    import re

    return bool(re.fullmatch(r"[a-z0-9][a-z0-9-]*", name))


def _str_table(where: str, t) -> tuple[tuple[str, str], ...]:
    if not isinstance(t, dict) or not all(isinstance(k, str) and isinstance(v, str) and v for k, v in t.items()):
        raise UsageError(f"{where}: a table of \"path\" = \"string\" expected")
    return tuple(t.items())


def parse_concerns_toml(path: Path) -> ConcernsSpec:
    data = _load_toml(path)
    _check_keys(str(path), data, set(), {"concern"})
    table = data.get("concern", {})
    if not isinstance(table, dict):
        raise UsageError(f"{path}: [concern.<name>] tables expected")
    concerns = {}
    for name, t in table.items():
        where = f"{path}: [concern.{name}]"
        if not valid_concern_name(name):
            raise UsageError(f"{where}: concern names are lowercase words joined by '-'")
        _check_keys(where, t, {"paths"}, {"title", "description", "tests", "not_carried", "results"})
        paths = t["paths"]
        if not isinstance(paths, list) or not paths or not all(isinstance(p, str) for p in paths):
            raise UsageError(f"{where}: paths must be a non-empty list of strings")
        for p in paths:
            if not (p.startswith("overlay/vllm/") or p.startswith("kernels/")):
                raise UsageError(f"{where}: path {p!r} must start with overlay/vllm/ or kernels/")
        for k in ("title", "description"):
            if k in t and not isinstance(t[k], str):
                raise UsageError(f"{where}: {k} must be a string")
        tests = _str_table(f"{where}.tests", t.get("tests", {}))
        for src, dest in tests:
            if not src.startswith("tests/") or not src.endswith(".py"):
                raise UsageError(f"{where}.tests: {src!r} must be a project test file (tests/....py)")
            if not dest.startswith("tests/") or not dest.rsplit("/", 1)[-1].startswith("test_") or not dest.endswith(".py"):
                raise UsageError(f"{where}.tests: {src!r} -> {dest!r}: the vLLM path must be tests/.../test_*.py")
        if len({d for _, d in tests}) != len(tests):
            raise UsageError(f"{where}.tests: two files map to the same vLLM path")
        not_carried = _str_table(f"{where}.not_carried", t.get("not_carried", {}))
        both = {s for s, _ in tests} & {s for s, _ in not_carried}
        if both:
            raise UsageError(f"{where}: {sorted(both)} both in tests and not_carried")
        results = t.get("results", [])
        if not isinstance(results, list) or not all(isinstance(r, dict) for r in results):
            raise UsageError(f"{where}.results: [[concern.{name}.results]] tables expected")
        for r in results:
            _check_keys(f"{where}.results", r, {"file", "kind"}, {"label", "keys", "values", "where"})
            if r["kind"] not in RESULT_KINDS:
                raise UsageError(f"{where}.results: kind {r['kind']!r} is not one of {', '.join(RESULT_KINDS)}")
            if r["kind"] == "records" and not (r.get("keys") and r.get("values")):
                raise UsageError(f"{where}.results: kind 'records' needs keys and values (field names of its records)")
        concerns[name] = Concern(name, tuple(paths), t.get("title"), t.get("description"),
                                 tests, not_carried, tuple(results))
    return ConcernsSpec(path, concerns)
