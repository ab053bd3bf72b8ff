"""pins.lock: the supported vLLM releases."""
from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from .errors import PinError

_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_REQUIRED = ("wheel", "sha256", "torch", "triton")
# Optional, together: the release's source distribution (an https URL ending in vllm-<version>.tar.gz)
# and its sha256 -- where vLLM's own tests come from (tools/apply.py upstream-tests; wheels have no tests/).
_OPTIONAL = ("sdist", "sdist_sha256")


@dataclass(frozen=True)
class Pin:
    version: str
    wheel: str
    sha256: str
    torch: str
    triton: str  # a PEP 440 specifier, as the pinned torch declares it
    sdist: str | None = None  # URL of the release's sdist (vllm-<version>.tar.gz)
    sdist_sha256: str | None = None

    @property
    def sdist_name(self) -> str:
        return f"vllm-{self.version}.tar.gz"

    @property
    def tag(self) -> str:
        """The git tag of the release (upstream vLLM tags releases as v<version>)."""
        return f"v{self.version}"

    @property
    def branch(self) -> str:
        return f"overlay/{self.version}"


@dataclass(frozen=True)
class Lock:
    path: Path
    default: str
    pins: dict[str, Pin]

    def get(self, version: str | None) -> Pin:
        v = version or self.default
        if v not in self.pins:
            known = ", ".join(sorted(self.pins))
            raise PinError(f"vLLM {v} is not pinned in {self.path} (pinned: {known})")
        return self.pins[v]

    @property
    def newest(self) -> str:
        """The newest pinned release by version order (export-pr's default: upstream PRs go against main)."""
        return max(self.pins, key=Version)


def load_lock(path: Path) -> Lock:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise PinError(f"lock file {path} not found") from None
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise PinError(f"{path}: not valid TOML: {e}") from None
    unknown = set(data) - {"default", "pins"}
    if unknown:
        raise PinError(f"{path}: unknown top-level keys {sorted(unknown)} (expected 'default' and [pins.\"X.Y.Z\"])")
    table = data.get("pins")
    if not isinstance(table, dict) or not table:
        raise PinError(f"{path}: no [pins.\"<version>\"] tables")
    pins: dict[str, Pin] = {}
    for version, entry in table.items():
        where = f"{path}: [pins.\"{version}\"]"
        try:
            Version(version)
        except InvalidVersion:
            raise PinError(f"{where}: '{version}' is not a version") from None
        if not isinstance(entry, dict):
            raise PinError(f"{where}: must be a table")
        missing = [k for k in _REQUIRED if k not in entry]
        if missing:
            raise PinError(f"{where}: missing {', '.join(missing)}")
        extra = set(entry) - set(_REQUIRED) - set(_OPTIONAL)
        if extra:
            raise PinError(f"{where}: unknown keys {sorted(extra)}")
        if not all(isinstance(entry[k], str) for k in _REQUIRED + tuple(k for k in _OPTIONAL if k in entry)):
            raise PinError(f"{where}: wheel, sha256, torch, triton, sdist and sdist_sha256 must be strings")
        if ("sdist" in entry) != ("sdist_sha256" in entry):
            raise PinError(f"{where}: sdist and sdist_sha256 go together (one is missing)")
        if "sdist" in entry:
            if not _SHA256.match(entry["sdist_sha256"]):
                raise PinError(f"{where}: sdist_sha256 must be 64 lowercase hex digits")
            if not (entry["sdist"].startswith("https://") and entry["sdist"].endswith(f"/vllm-{version}.tar.gz")):
                raise PinError(f"{where}: sdist '{entry['sdist']}' is not an https URL of vllm-{version}.tar.gz")
        if not _SHA256.match(entry["sha256"]):
            raise PinError(f"{where}: sha256 must be 64 lowercase hex digits")
        wheel = entry["wheel"]
        if not (wheel.endswith(".whl") and wheel.startswith(f"vllm-{version}-")):
            raise PinError(f"{where}: wheel '{wheel}' is not a vllm-{version}-*.whl file name")
        try:
            Version(entry["torch"])
        except InvalidVersion:
            raise PinError(f"{where}: torch '{entry['torch']}' is not a version") from None
        try:
            SpecifierSet(entry["triton"])
        except InvalidSpecifier:
            raise PinError(f"{where}: triton '{entry['triton']}' is not a version specifier (e.g. '==3.6.0')") from None
        pins[version] = Pin(version, wheel, entry["sha256"], entry["torch"], entry["triton"],
                            entry.get("sdist"), entry.get("sdist_sha256"))
    default = data.get("default")
    if not isinstance(default, str) or default not in pins:
        raise PinError(f"{path}: default = {default!r} is not one of the pins ({', '.join(sorted(pins))})")
    return Lock(path, default, pins)
