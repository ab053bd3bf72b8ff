"""Series files, patch files and their headers.

A patch is one commit in `git format-patch` form. Its commit message carries the header:

    [Tag] Subject line                      <- title; the [Tag]s are vLLM's PR title tags

    Why the patch exists (one or more paragraphs).

    Concern: attention-routing               <- groups patches (and overlay files) into one upstream PR
    Applied-Upstream: v0.28.0, https://...   <- and/or Forwarded: <url> | no | not-needed
    Last-Update: 2026-12-02
"""
from __future__ import annotations

import datetime as _dt
import email
import email.header
import email.policy
import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path

from .errors import CheckError, UsageError

AUTHOR_NAME = "GLM-5 overlay"
AUTHOR_EMAIL = "glm5-overlay@users.noreply.github.com"
AUTHOR = f"{AUTHOR_NAME} <{AUTHOR_EMAIL}>"
# Fixed author/committer date of every commit the tool writes (so exports and commit ids are stable).
FIXED_DATE = "Thu, 1 Jan 2026 00:00:00 +0000"
FIXED_EPOCH = 1767225600  # the same instant

SERIES_HEADER = (
    "# Patches applied in this order by tools/apply.py (one commit each).\n"
    "# Written by `tools/apply.py refresh`; lines starting with # are ignored.\n"
)

FIELD_RE = re.compile(r"^([A-Za-z][A-Za-z0-9-]*):[ \t]*(.*)$")
TITLE_RE = re.compile(r"^(\[[^\]\s][^\]]*\])+ +\S")
CONCERN_RE = re.compile(r"^[a-z0-9][a-z0-9-]*$")
KNOWN_FIELDS = {
    "Concern", "Forwarded", "Applied-Upstream", "Last-Update", "Origin", "Bug", "Bug-Upstream",
    "Author", "Reviewed-by", "Signed-off-by", "Co-authored-by", "Depends-On",
}


# ----------------------------------------------------------------------- series
def read_series(patches_dir: Path) -> list[str]:
    """Patch file names listed in patches_dir/series, in order ([] if there is no series file)."""
    series = patches_dir / "series"
    if not series.is_file():
        return []
    names = []
    for n, line in enumerate(series.read_text(encoding="utf-8").splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if "/" in line or line.startswith(".") or not line.endswith(".patch"):
            raise UsageError(f"{series}:{n}: '{line}' is not a patch file name in {patches_dir.name}/ (*.patch)")
        if line in names:
            raise UsageError(f"{series}:{n}: '{line}' is listed twice")
        if not (patches_dir / line).is_file():
            raise UsageError(f"{series}:{n}: {line} is listed but {patches_dir / line} does not exist")
        names.append(line)
    return names


def format_series(names: list[str]) -> str:
    return SERIES_HEADER + "".join(n + "\n" for n in names)


def patch_file_name(index: int, subject: str) -> str:
    """Deterministic file name: NNNN-<subject reduced to [A-Za-z0-9._-]>.patch (at most 64 chars before .patch)."""
    slug = re.sub(r"[^A-Za-z0-9._]+", "-", subject).strip("-.")
    slug = re.sub(r"\.{2,}", ".", slug)[:58].rstrip("-.")
    return f"{index:04d}-{slug or 'patch'}.patch"


# ------------------------------------------------------------------ messages
@dataclass
class Header:
    subject: str
    description: str  # the "why": body text before the field block
    fields: dict[str, list[str]] = field(default_factory=dict)

    def get(self, key: str) -> str | None:
        v = self.fields.get(key)
        return v[0] if v else None

    @property
    def concern(self) -> str | None:
        return self.get("Concern")

    @property
    def tags(self) -> list[str]:
        m = re.match(r"^((?:\[[^\]]+\])+)", self.subject)
        return re.findall(r"\[([^\]]+)\]", m.group(1)) if m else []


def parse_message(message: str) -> Header:
    """Split a commit message into subject, description and the trailing field block."""
    text = message.replace("\r\n", "\n").strip("\n")
    parts = text.split("\n\n")
    subject = " ".join(parts[0].split("\n")).strip()
    paras = parts[1:]
    fields: dict[str, list[str]] = {}
    if paras:
        last = paras[-1].split("\n")
        if last and all(FIELD_RE.match(line) or (line[:1] in (" ", "\t") and i > 0) for i, line in enumerate(last)):
            key = None
            for line in last:
                m = FIELD_RE.match(line)
                if m:
                    key = m.group(1)
                    fields.setdefault(key, []).append(m.group(2).strip())
                else:
                    fields[key][-1] += " " + line.strip()
            paras = paras[:-1]
    return Header(subject, "\n\n".join(paras).strip(), fields)


def validate_header(h: Header, where: str) -> list[str]:
    """Problems with a patch header (empty list: valid)."""
    problems = []
    if not TITLE_RE.match(h.subject):
        problems.append(f"{where}: subject must start with vLLM title tag(s) such as [Attention], [Kernel], [Model]: '{h.subject}'")
    if not h.description:
        problems.append(f"{where}: no description: say why the patch exists in the message body")
    concern = h.fields.get("Concern", [])
    if len(concern) != 1 or not CONCERN_RE.match(concern[0]):
        problems.append(f"{where}: needs exactly one 'Concern: <lowercase-words>' field")
    if not (h.fields.get("Forwarded") or h.fields.get("Applied-Upstream")):
        problems.append(f"{where}: needs an upstream status: 'Forwarded: <url>|no|not-needed' and/or 'Applied-Upstream: <version/commit/url>'")
    lu = h.fields.get("Last-Update", [])
    if len(lu) != 1:
        problems.append(f"{where}: needs exactly one 'Last-Update: YYYY-MM-DD' field")
    else:
        try:
            _dt.date.fromisoformat(lu[0])
            if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", lu[0]):
                raise ValueError
        except ValueError:
            problems.append(f"{where}: Last-Update '{lu[0]}' is not a YYYY-MM-DD date")
    unknown = set(h.fields) - KNOWN_FIELDS
    if unknown:
        problems.append(f"{where}: unknown header fields {sorted(unknown)} (known: {', '.join(sorted(KNOWN_FIELDS))})")
    return problems


# ------------------------------------------------------------------- patches
@dataclass
class Hunk:
    index: int  # 1-based, per file
    old_start: int
    old_len: int
    new_start: int
    new_len: int
    header: str


@dataclass
class FilePatch:
    old_path: str | None  # None: file created
    new_path: str | None  # None: file deleted
    hunks: list[Hunk] = field(default_factory=list)
    binary: bool = False

    @property
    def path(self) -> str:
        return self.new_path or self.old_path  # type: ignore[return-value]


@dataclass
class PatchFile:
    name: str
    path: Path
    data: bytes
    header: Header
    files: list[FilePatch]

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    def hunk_at(self, path: str, line: int) -> Hunk | None:
        for f in self.files:
            if path in (f.old_path, f.new_path):
                for h in f.hunks:
                    if h.old_start == line:
                        return h
        return None


def _decode_header(value: str) -> str:
    parts = []
    for chunk, enc in email.header.decode_header(value):
        parts.append(chunk.decode(enc or "utf-8", "replace") if isinstance(chunk, bytes) else chunk)
    return "".join(parts)


def parse_patch_bytes(name: str, path: Path, data: bytes) -> PatchFile:
    """Parse a git format-patch file (mail header, message, diff)."""
    text = data.decode("utf-8", "replace")
    head, sep, _ = text.partition("\ndiff --git ")
    if not sep:
        raise UsageError(f"{path}: not a git patch (no 'diff --git' line)")
    msg = email.message_from_string(head.split("\n---\n")[0] + "\n", policy=email.policy.compat32)
    subject = msg.get("Subject")
    if subject is None or not msg.get("From"):
        raise UsageError(f"{path}: not in git format-patch form (no From:/Subject: mail header)")
    subject = " ".join(_decode_header(subject).split())
    payload = msg.get_payload()
    body = payload if isinstance(payload, str) else ""
    header = parse_message(subject + "\n\n" + body)
    return PatchFile(name, path, data, header, parse_diff(text[len(head) + 1 :]))


def parse_patch_file(path: Path) -> PatchFile:
    return parse_patch_bytes(path.name, path, path.read_bytes())


_HUNK_RE = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def parse_diff(text: str) -> list[FilePatch]:
    files: list[FilePatch] = []
    cur: FilePatch | None = None
    for line in text.split("\n"):
        if line.startswith("diff --git "):
            m = re.match(r"^diff --git a/(.+) b/(.+)$", line)
            if not m:
                raise UsageError(f"cannot parse '{line}'")
            cur = FilePatch(m.group(1), m.group(2))
            files.append(cur)
        elif cur is None:
            continue
        elif line.startswith("new file mode"):
            cur.old_path = None
        elif line.startswith("deleted file mode"):
            cur.new_path = None
        elif line.startswith("rename from ") or line.startswith("rename to "):
            raise UsageError("patches with renames are not supported: export with --no-renames (refresh does)")
        elif line.startswith("GIT binary patch") or line.startswith("Binary files "):
            cur.binary = True
        elif line.startswith("@@ "):
            m = _HUNK_RE.match(line)
            if m:
                cur.hunks.append(
                    Hunk(len(cur.hunks) + 1, int(m.group(1)), int(m.group(2) or 1), int(m.group(3)), int(m.group(4) or 1), line)
                )
    return files


def load_series(patches_dir: Path) -> list[PatchFile]:
    """The series' patches, in order; a missing series file is an error (an empty series is a file with no entries)."""
    series = patches_dir / "series"
    if not series.is_file():
        raise UsageError(
            f"{series} does not exist (an empty series is a file with no entries; `refresh` writes it from a tree, "
            f"`git checkout -- {series}` restores a deleted one)"
        )
    return [parse_patch_file(patches_dir / n) for n in read_series(patches_dir)]


def patches_fingerprint(patches_dir: Path) -> str:
    """sha256 over patches/<version>/: the series file and every *.patch file (names and bytes)."""
    h = hashlib.sha256()
    series = patches_dir / "series"
    h.update(b"series\0" + (series.read_bytes() if series.is_file() else b"(missing)") + b"\0")
    for p in sorted(patches_dir.glob("*.patch")) if patches_dir.is_dir() else []:
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def validate_series(patches: list[PatchFile]) -> list[str]:
    problems = []
    for p in patches:
        problems += validate_header(p.header, p.name)
        for f in p.files:
            if f.binary:
                problems.append(f"{p.name}: {f.path} is a binary change; binary files belong in overlay/, not in patches")
    return problems


def require_valid(patches: list[PatchFile]) -> None:
    problems = validate_series(patches)
    if problems:
        raise CheckError("invalid patch headers:\n  " + "\n  ".join(problems))


# ------------------------------------------------------------- normalisation
def normalize_export(data: bytes) -> bytes:
    """Fix the parts of `git format-patch` output that depend on who committed when."""
    lines = data.split(b"\n")
    out = []
    in_head = True
    replaced = False
    for line in lines:
        if in_head:
            if replaced and line[:1] in (b" ", b"\t"):
                continue  # continuation of a folded From:/Date: header we replaced
            replaced = False
            if line.startswith(b"From: "):
                line, replaced = b"From: " + AUTHOR.encode(), True
            elif line.startswith(b"Date: "):
                line, replaced = b"Date: " + FIXED_DATE.encode(), True
            elif line == b"":
                in_head = False
        out.append(line)
    return b"\n".join(out)
