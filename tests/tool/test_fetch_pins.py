"""pins.lock parsing and the wheel cache (download with pip, sha256 on every use)."""
from __future__ import annotations

import shutil

from conftest import make_project, make_wheel, sha256


def test_cached_wheel_hash_mismatch_is_refused_and_left_alone(proj):
    p = proj
    w = p.cache / "vllm-9.9.0-py3-none-any.whl"
    w.write_bytes(w.read_bytes() + b"tampered")
    before = w.read_bytes()
    r = p.run("fetch", check_rc=4)
    assert f"sha256 mismatch for {w}" in r.out and "expected" in r.out and "delete it to download it again" in r.out
    assert w.read_bytes() == before
    r = p.run("apply", check_rc=4)  # every use verifies
    assert not (p.root / "work").exists()


def test_download_with_pip_when_absent(tmp_path):
    p = make_project(tmp_path)
    index = tmp_path / "index"
    index.mkdir()
    shutil.move(str(p.cache / "vllm-9.9.0-py3-none-any.whl"), index)
    env = {"GLM5_OVERLAY_PIP_DOWNLOAD_ARGS": f"--no-index --find-links {index}"}
    r = p.run("--dry-run", "fetch", env=env, check_rc=0)
    assert "would download vllm==9.9.0" in r.out and not any(p.cache.iterdir())
    r = p.run("fetch", env=env, check_rc=0)
    assert "(downloaded, sha256 verified)" in r.out
    assert sha256(p.cache / "vllm-9.9.0-py3-none-any.whl") == sha256(index / "vllm-9.9.0-py3-none-any.whl")
    assert [x.name for x in p.cache.iterdir()] == ["vllm-9.9.0-py3-none-any.whl"]


def test_downloaded_wheel_with_wrong_hash_is_discarded(tmp_path):
    p = make_project(tmp_path)
    index = tmp_path / "index"
    (p.cache / "vllm-9.9.0-py3-none-any.whl").unlink()
    make_wheel(index, "9.9.0", compiled=b"another build")  # same name, other bytes
    r = p.run("fetch", env={"GLM5_OVERLAY_PIP_DOWNLOAD_ARGS": f"--no-index --find-links {index}"}, check_rc=4)
    assert "sha256 mismatch for the downloaded vllm-9.9.0-py3-none-any.whl" in r.out and "nothing was cached" in r.out
    assert list(p.cache.iterdir()) == []


def test_failed_download_is_a_fetch_error(tmp_path):
    p = make_project(tmp_path)
    (p.cache / "vllm-9.9.0-py3-none-any.whl").unlink()
    (tmp_path / "empty").mkdir()
    r = p.run("fetch", env={"GLM5_OVERLAY_PIP_DOWNLOAD_ARGS": f"--no-index --find-links {tmp_path / 'empty'}"}, check_rc=4)
    assert "pip download of vllm==9.9.0 failed" in r.out


def test_lock_errors(proj):
    p = proj
    lock = p.root / "pins.lock"
    good = lock.read_text()
    cases = {
        good.replace('default = "9.9.0"', 'default = "1.0"'): "default = '1.0' is not one of the pins (9.9.0)",
        good.replace("sha256 = ", "sha = "): 'missing sha256',
        good.replace('triton = "==3.6.0"', 'triton = "3.6"'): "triton '3.6' is not a version specifier",
        good.replace('wheel = "vllm-9.9.0', 'wheel = "torch-9.9.0'): "is not a vllm-9.9.0-*.whl file name",
        good + "\n[extra]\n": "unknown top-level keys ['extra']",
        "default = [": "not valid TOML",
    }
    for text, msg in cases.items():
        lock.write_text(text)
        r = p.run("status", check_rc=3)
        assert msg in r.out, (msg, r.out)


def test_real_lock_pins_every_release():
    from conftest import REPO
    from overlay_tool.pins import load_lock

    lock = load_lock(REPO / "pins.lock")
    assert lock.default == "0.26.0"
    assert (lock.pins["0.26.0"].torch, lock.pins["0.26.0"].triton) == ("2.11.0", "==3.6.0")
    assert (lock.pins["0.33.0"].torch, lock.pins["0.33.0"].triton) == ("2.14.0", "~=3.8.0")
    assert lock.pins["0.33.0"].wheel == "vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    assert sorted(lock.pins) == ["0.26.0", "0.33.0", "0.34.0"]
    # 0.34.0: Requires-Dist torch==2.14.0 (read from the wheel), whose own triton requirement pip
    # reports as triton~=3.8.0; the sha256 is PyPI's for that file
    assert (lock.pins["0.34.0"].torch, lock.pins["0.34.0"].triton) == ("2.14.0", "~=3.8.0")
    assert lock.pins["0.34.0"].wheel == "vllm-0.34.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    assert lock.pins["0.34.0"].sha256 == "79ca4b3cd74aec08c4bf476bdf0cb15735b605ae5368526a2faae1e30f044ca2"
