"""vLLM's own tests from the pinned sdist: pins.lock's sdist/sdist_sha256, the sdist cache (sha256
checked on every use, a bad download never cached), `upstream-tests` (the listed files extracted,
our test patches applied, the bundle refused over a foreign folder), with synthetic sdists; and the
real pins' entries and test patches."""
from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import tarfile
from pathlib import Path

import pytest
from conftest import REPO, make_project

from overlay_tool import upstream_tests as UT
from overlay_tool.errors import FetchError, PinError, UsageError
from overlay_tool.pins import load_lock

TEST_V1 = "import pytest\n\nBACKENDS = ['A', 'B']\n\n\ndef test_x():\n    assert len(BACKENDS) == 2\n"
TEST_V2 = TEST_V1.replace("['A', 'B']", "['A', 'B', 'OURS']").replace("== 2", "== 3")
UPSTREAM = {"pyproject.toml": "[tool.pytest.ini_options]\nmarkers = []\n", "tests/__init__.py": "",
            "tests/conftest.py": "", "tests/v1/attention/test_x.py": TEST_V1, "tests/unrelated.py": "X = 1\n"}
FILES = ["pyproject.toml", "tests/__init__.py", "tests/conftest.py", "tests/v1/attention/test_x.py"]


def make_sdist(dest: Path, version: str, files: dict[str, str]) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    path = dest / f"vllm-{version}.tar.gz"
    with tarfile.open(path, "w:gz") as t:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"vllm-{version}/{name}")
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    return path


def test_patch(tmp: Path, rel: str, before: str, after: str, subject: str, concern: str) -> bytes:
    """A test patch in the tool's format-patch form, made with git."""
    d = tmp / "mk"
    (d / rel).parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, GIT_AUTHOR_NAME="GLM-5 overlay", GIT_AUTHOR_EMAIL="glm5-overlay@users.noreply.github.com",
               GIT_COMMITTER_NAME="x", GIT_COMMITTER_EMAIL="x@x", GIT_AUTHOR_DATE="Thu, 1 Jan 2026 00:00:00 +0000")
    run = lambda *a, **k: subprocess.run(["git", *a], cwd=d, env=env, check=True, capture_output=True, **k)  # noqa: E731
    run("init", "-q")
    (d / rel).write_text(before)
    run("add", "-A")
    run("commit", "-qm", "base")
    (d / rel).write_text(after)
    msg = f"{subject}\n\nWhy: the suite runs on our backend too.\n\nConcern: {concern}\nForwarded: no\nLast-Update: 2026-12-03\n"
    run("commit", "-qa", "-F", "-", input=msg.encode())
    return run("format-patch", "--full-index", "--zero-commit", "--no-signature", "--keep-subject", "-1", "--stdout").stdout


test_patch.__test__ = False  # a helper, not a test


def add_upstream_tests(p, tmp: Path, version: str = "9.9.0", concern: str = "triton-k",
                       files: list[str] | None = None, before: str = TEST_V1, after: str = TEST_V2) -> Path:
    """Pin an sdist for `version` (cached under tmp/sdists) and write patches/<version>/tests."""
    sdist = make_sdist(tmp / "sdist-src", version, UPSTREAM)
    digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
    text = "".join(ln for ln in (p.root / "pins.lock").read_text().splitlines(True) if not ln.startswith("sdist"))
    lock = text.replace(
        f'[pins."{version}"]\n', f'[pins."{version}"]\nsdist = "https://files.example.org/x/vllm-{version}.tar.gz"\n'
        f'sdist_sha256 = "{digest}"\n')
    (p.root / "pins.lock").write_text(lock)
    cache = tmp / "sdists"
    cache.mkdir(exist_ok=True)
    (cache / sdist.name).write_bytes(sdist.read_bytes())
    d = p.patches(version) / "tests"
    d.mkdir(parents=True, exist_ok=True)
    name = "0001-Test-Run-test_x-on-OURS.patch"
    (d / name).write_bytes(test_patch(tmp, "tests/v1/attention/test_x.py", before, after, "[Test] Run test_x on OURS", concern))
    (d / "series").write_text(f"# test patches\n{name}\n")
    (d / "files").write_text("# the files\n" + "".join(f + "\n" for f in (files or FILES)))
    return cache


def _env(cache: Path) -> dict:
    return {UT.SDIST_CACHE_ENV: str(cache)}


# ------------------------------------------------------------------ pins.lock
def test_lock_takes_an_optional_sdist_pair(tmp_path):
    p = make_project(tmp_path)
    add_upstream_tests(p, tmp_path)
    pin = load_lock(p.root / "pins.lock").get("9.9.0")
    assert pin.sdist.endswith("/vllm-9.9.0.tar.gz") and len(pin.sdist_sha256) == 64 and pin.sdist_name == "vllm-9.9.0.tar.gz"
    text = (p.root / "pins.lock").read_text()
    for bad, why in [
        (text.replace("sdist_sha256", "xsdist_sha256"), "unknown keys"),
        ("\n".join(ln for ln in text.splitlines() if not ln.startswith("sdist_sha256")) + "\n", "go together"),
        (text.replace("https://files.example.org/x/vllm-9.9.0.tar.gz", "http://x/vllm-9.9.0.tar.gz"), "https URL"),
        (text.replace("https://files.example.org/x/vllm-9.9.0.tar.gz", "https://x/vllm-1.0.0.tar.gz"), "https URL"),
        (text.replace(pin.sdist_sha256, "ABC"), "64 lowercase hex"),
    ]:
        (p.root / "pins.lock").write_text(bad)
        with pytest.raises(PinError, match=why):
            load_lock(p.root / "pins.lock")


def test_real_pins_lock_pins_every_sdist():
    lock = load_lock(REPO / "pins.lock")
    for v, pin in lock.pins.items():
        assert pin.sdist and pin.sdist.startswith("https://files.pythonhosted.org/") and pin.sdist.endswith(f"/vllm-{v}.tar.gz")
        assert len(pin.sdist_sha256) == 64


def test_real_test_sets_name_the_listed_files():
    lock = load_lock(REPO / "pins.lock")
    for v in lock.pins:
        ts = UT.load_test_set(REPO / "patches" / v)
        assert ts is not None, f"patches/{v}/tests is missing"
        assert "tests/v1/attention/test_sparse_mla_backends.py" in ts.files and "tests/conftest.py" in ts.files
        assert [p.header.concern for p in ts.patches] == ["triton-mla-sparse-backend"]
        assert ts.patches[0].header.subject.startswith("[Test] ")


# ------------------------------------------------------------------ fetch
def test_fetch_checks_the_cached_sdist_every_time(tmp_path):
    p = make_project(tmp_path)
    cache = add_upstream_tests(p, tmp_path)
    pin = load_lock(p.root / "pins.lock").get("9.9.0")
    assert UT.fetch_sdist(pin, cache, log=lambda *_: None) == cache / pin.sdist_name
    (cache / pin.sdist_name).write_bytes(b"tampered")
    with pytest.raises(FetchError, match="sha256 mismatch"):
        UT.fetch_sdist(pin, cache, log=lambda *_: None)


def test_fetch_downloads_verifies_and_caches(tmp_path, monkeypatch):
    p = make_project(tmp_path)
    add_upstream_tests(p, tmp_path)
    pin = load_lock(p.root / "pins.lock").get("9.9.0")
    good = (tmp_path / "sdist-src" / pin.sdist_name).read_bytes()
    served = {"data": b"not the release"}

    def urlopen(url, timeout):
        assert url == pin.sdist
        return io.BytesIO(served["data"])

    monkeypatch.setattr(UT.urllib.request, "urlopen", urlopen)
    cache = tmp_path / "fresh"
    with pytest.raises(FetchError, match="nothing was cached"):
        UT.fetch_sdist(pin, cache, log=lambda *_: None)
    assert not (cache / pin.sdist_name).exists() and not [x for x in cache.iterdir() if not x.name.endswith(".owner")]
    served["data"] = good
    assert UT.fetch_sdist(pin, cache, log=lambda *_: None).read_bytes() == good


def test_fetch_without_a_pinned_sdist_is_a_usage_error(tmp_path):
    p = make_project(tmp_path)
    pin = load_lock(p.root / "pins.lock").get("9.9.0")
    with pytest.raises(UsageError, match="no sdist"):
        UT.fetch_sdist(pin, tmp_path, log=lambda *_: None)


# ------------------------------------------------------------------ upstream-tests
def test_upstream_tests_writes_the_patched_bundle(tmp_path):
    p = make_project(tmp_path)
    cache = add_upstream_tests(p, tmp_path)
    out = tmp_path / "bundle"
    r = p.run("upstream-tests", "--out", str(out), env=_env(cache), check_rc=0)
    assert "4 file(s) of vllm-9.9.0.tar.gz" in r.out
    assert sorted(str(x.relative_to(out)) for x in out.rglob("*") if x.is_file()) == sorted(FILES + [UT.BUNDLE_MANIFEST])
    assert (out / "tests/v1/attention/test_x.py").read_text() == TEST_V2
    m = json.loads((out / UT.BUNDLE_MANIFEST).read_text())
    assert m["vllm"] == "9.9.0" and m["patched"] == ["tests/v1/attention/test_x.py"]
    assert m["patches"] == ["0001-Test-Run-test_x-on-OURS.patch"]
    # the bundle runs as a pytest rootdir of its own
    t = subprocess.run([os.sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/v1/attention/test_x.py"],
                       cwd=out, capture_output=True, text=True)
    assert t.returncode == 0, t.stdout + t.stderr
    # again: the bundle is replaced; a foreign folder is refused
    p.run("upstream-tests", "--out", str(out), env=_env(cache), check_rc=0)
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "mine.txt").write_text("keep")
    r = p.run("upstream-tests", "--out", str(tmp_path / "foreign"), env=_env(cache), check_rc=5)
    assert (tmp_path / "foreign" / "mine.txt").read_text() == "keep"
    r = p.run("--dry-run", "upstream-tests", "--out", str(tmp_path / "dry"), env=_env(cache), check_rc=0)
    assert "would write" in r.out and not (tmp_path / "dry").exists()


def test_upstream_tests_failures_are_named(tmp_path):
    p = make_project(tmp_path)
    cache = add_upstream_tests(p, tmp_path, files=FILES + ["tests/not_in_sdist.py"])
    r = p.run("upstream-tests", "--out", str(tmp_path / "b"), env=_env(cache), check_rc=2)
    assert "has no tests/not_in_sdist.py" in r.out
    cache = add_upstream_tests(p, tmp_path, files=[f for f in FILES if not f.endswith("test_x.py")])
    r = p.run("upstream-tests", "--out", str(tmp_path / "b"), env=_env(cache), check_rc=2)
    assert "which" in r.out and "does not list" in r.out
    cache = add_upstream_tests(p, tmp_path, before=TEST_V1.replace("import pytest", "import os"))
    r = p.run("upstream-tests", "--out", str(tmp_path / "b"), env=_env(cache), check_rc=6)
    assert "does not apply" in r.out and not (tmp_path / "b").exists()
    (p.patches("9.9.0") / "tests" / "files").unlink()
    r = p.run("upstream-tests", "--out", str(tmp_path / "b"), env=_env(cache), check_rc=2)
    assert "no 'files' list" in r.out


def test_upstream_tests_of_a_pin_without_test_patches(tmp_path):
    p = make_project(tmp_path)
    r = p.run("upstream-tests", "--out", str(tmp_path / "b"), check_rc=2)
    assert "patches/9.9.0/tests does not exist" in r.out


@pytest.mark.parametrize("version", ["0.26.0", "0.33.0", "0.34.0"])
def test_real_test_patches_apply_to_the_pinned_sdists(tmp_path, version):
    """Every pin's test patch applies to its sdist (where the sdist is cached here; the download is
    what `upstream-tests` does, not this test)."""
    pin = load_lock(REPO / "pins.lock").get(version)
    cache = UT.default_sdist_cache()
    if not (cache / pin.sdist_name).exists():
        pytest.skip(f"{pin.sdist_name} is not in {cache} (tools/apply.py upstream-tests --vllm {version} downloads it)")

    class _P:
        root = REPO

        def patches_dir(self, pin):
            return REPO / "patches" / pin.version

    ts, files, steps = UT.patched_files(_P(), pin, cache, log=lambda *_: None)
    (patch, changes), = steps
    after = changes["tests/v1/attention/test_sparse_mla_backends.py"][1].decode()
    assert "from vllm.v1.attention.backends.mla.triton_mla_sparse import TritonMLASparseBackend" in after
    assert '"TritonMLASparse"' in after


def test_pr_results_quote_an_upstream_tests_file_per_backend(tmp_path):
    """A CONCERNS.toml results entry of kind "pytest" may name e2e/upstream_tests.py's file: PR.md
    quotes its counts per backend."""
    from overlay_tool.carry import results_section

    (tmp_path / "r.json").write_text(json.dumps({
        "commit": "abc1234", "command": "python3 e2e/upstream_tests.py --commit abc1234",
        "environment": {"gpu": "NVIDIA H200", "torch": "2.11.0", "triton": "3.6.0"},
        "backends": {"FlashMLA": {"counts": {"passed": 84, "failed": 0, "error": 0, "skipped": 168}},
                     "TritonMLASparse": {"counts": {"passed": 126, "failed": 0, "error": 0, "skipped": 126}}}}))
    lines = results_section(tmp_path, [{"file": "r.json", "kind": "pytest", "label": "vLLM's own test"}])
    assert "  - `TritonMLASparse`: 126 passed, 0 failed, 0 error, 126 skipped" in lines
    assert "  - `FlashMLA`: 84 passed, 0 failed, 0 error, 168 skipped" in lines
