"""e2e/gpu_tests.py without a GPU: reading pytest's results, the results file, merging partial files,
the exit status, and --prepare's staging of vLLM's compiled library."""
from __future__ import annotations

import json
import lzma
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import gpu_tests as G

SCRIPT = Path(G.__file__)

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="1" failures="1"
skipped="2" tests="6"><testcase classname="tests.kernels.test_dsa_topk" name="test_a[4096-1]" time="0.1"/>
<testcase classname="tests.kernels.test_dsa_topk" name="test_b" time="0.1"><failure message="assert 1 == 2">x</failure></testcase>
<testcase classname="tests.kernels.test_sparse_mla.TestX" name="test_c" time="0.1"><error message="boom">y</error></testcase>
<testcase classname="tests.kernels.test_sparse_mla" name="test_d" time="0"><skipped type="pytest.skip" message="needs sm_100">z</skipped></testcase>
<testcase classname="tests.kernels.test_sparse_mla" name="test_e" time="0"><skipped type="pytest.skip" message="needs sm_100">z</skipped></testcase>
<testcase classname="tests.kernels.test_sparse_mla" name="test_f" time="0"><skipped type="pytest.xfail" message="known">z</skipped></testcase>
</testsuite></testsuites>"""


def test_parse_junit_counts_and_names_every_outcome():
    r = G.parse_junit(JUNIT)
    assert r["counts"] == {"passed": 1, "failed": 1, "error": 1, "skipped": 2, "xfailed": 1, "xpassed": 0}
    assert r["failed"] == ["tests/kernels/test_dsa_topk.py::test_b"]
    assert r["errors"] == ["tests/kernels/test_sparse_mla.py::TestX::test_c"]
    assert r["skip_reasons"] == {"needs sm_100": 2}


def test_parse_verbose_keeps_what_finished_before_a_cutoff():
    text = ("tests/kernels/test_a.py::test_x[1-2] PASSED      [  1%]\n"
            "tests/kernels/test_a.py::test_y FAILED                [  2%]\n"
            "tests/kernels/test_a.py::test_z SKIPPED (needs x)     [  3%]\n"
            "tests/kernels/test_b.py::test_w ")  # killed while this one ran
    r = G.parse_verbose(text)
    assert r["counts"]["passed"] == 1 and r["counts"]["failed"] == 1 and r["counts"]["skipped"] == 1
    assert r["failed"] == ["tests/kernels/test_a.py::test_y"]


def _mode(passed=3, failed=(), rc=0, timed_out=False):
    counts = dict.fromkeys(G.COUNT_KEYS, 0)
    counts.update(passed=passed, failed=len(failed))
    m = {"counts": counts, "failed": list(failed), "errors": [], "skip_reasons": {}, "returncode": rc,
         "timed_out": timed_out, "seconds": 1.0}
    m["ok"] = G.mode_ok(m)
    return m


def _doc(modes, commit="abc", gpu="NVIDIA H200"):
    return G.summarize({"name": G.NAME, "command": "python3 e2e/gpu_tests.py", "commit": commit,
                        "tree_sha256": {"kernels": "k"}, "environment": {"gpu": gpu, "torch": "2.11.0", "triton": "3.6.0"},
                        "tests": "tests/kernels", "peers": None, "modes": modes})


def test_a_mode_is_ok_only_when_it_finished_cleanly():
    assert _mode()["ok"]
    assert not _mode(failed=["t::a"], rc=1)["ok"]
    assert not _mode(timed_out=True, rc=None)["ok"]
    assert not _mode(passed=0)["ok"]  # nothing ran
    assert not _mode(rc=2)["ok"]  # e.g. a collection error


def test_merge_combines_modes_and_refuses_mismatches():
    a = _doc({"plain": _mode()})
    b = _doc({"mma-v2": _mode(failed=["tests/kernels/test_dsa_topk.py::test_b"], rc=1)})
    m = G.merge([a, b], "python3 e2e/gpu_tests.py --merge a.json b.json")
    assert sorted(m["modes"]) == ["mma-v2", "plain"] and not m["ok"]
    assert m["totals"]["failed"] == 1 and m["totals"]["passed"] == 6
    assert m["command"].endswith("--merge a.json b.json")
    assert [x["modes"] for x in m["merged_from"]] == [["plain"], ["mma-v2"]]
    assert G.merge([a, _doc({"mma-v2": _mode()})], "c")["ok"]
    with pytest.raises(ValueError, match="commit"):
        G.merge([a, _doc({"mma-v2": _mode()}, commit="def")], "c")
    with pytest.raises(ValueError, match="gpu"):
        G.merge([a, _doc({"mma-v2": _mode()}, gpu="NVIDIA A100")], "c")
    with pytest.raises(ValueError, match="more than one"):
        G.merge([a, _doc({"plain": _mode()})], "c")


def _project(tmp_path: Path) -> Path:
    d = tmp_path / "suite"
    d.mkdir()
    (d / "test_fake.py").write_text(
        "import os\n\n"
        "def test_pass():\n    pass\n\n"
        "def test_env_of_the_mode():\n"
        "    assert os.environ['GLM5_REQUIRE_PEERS'] == '1'\n"
        "    assert os.environ.get('DISABLE_MMA_V3') == os.environ['EXPECT_MMA_V3_OFF']\n\n"
        "def test_skip():\n    import pytest; pytest.skip('no sm_100 here')\n")
    return d


def _run(tmp_path, *args, env_extra=None):
    import os

    env = {**os.environ, **(env_extra or {})}
    env.pop("OUT", None)
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env,
                          timeout=300)


def test_runs_each_mode_in_its_environment_and_writes_the_file(tmp_path):
    suite = _project(tmp_path)
    out = tmp_path / "out"
    r = _run(tmp_path, "--modes", "mma-v2", "--tests", str(suite), "--out", str(out), "--name", "x",
             "--commit", "c0ffee", "--allow-no-gpu", env_extra={"EXPECT_MMA_V3_OFF": "1"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    doc = json.loads((out / "x.json").read_text())
    m = doc["modes"]["mma-v2"]
    assert m["counts"]["passed"] == 2 and m["counts"]["skipped"] == 1 and m["ok"] and doc["ok"]
    assert m["env"] == {"DISABLE_MMA_V3": "1", "GLM5_REQUIRE_PEERS": "1"}
    assert m["skip_reasons"] and "no sm_100 here" in next(iter(m["skip_reasons"]))
    assert doc["commit"] == "c0ffee" and "--modes mma-v2" in doc["command"]
    assert set(doc["tree_sha256"]) == {"kernels", "tests/kernels"}
    assert {"torch", "triton", "python"} <= set(doc["environment"])


def test_a_failing_mode_makes_the_call_fail_and_is_named(tmp_path):
    suite = _project(tmp_path)
    out = tmp_path / "out"
    # plain mode with EXPECT_MMA_V3_OFF=1: test_env_of_the_mode fails there
    r = _run(tmp_path, "--modes", "plain", "--tests", str(suite), "--out", str(out), "--allow-no-gpu",
             env_extra={"EXPECT_MMA_V3_OFF": "1", "DISABLE_MMA_V3": "1"})
    assert r.returncode == 1
    doc = json.loads((out / f"{G.NAME}.json").read_text())
    m = doc["modes"]["plain"]
    assert not doc["ok"] and m["counts"]["failed"] == 1
    assert len(m["failed"]) == 1 and m["failed"][0].endswith("test_fake.py::test_env_of_the_mode")
    assert "FAILED" in r.stdout


def test_merge_cli_exit_status(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(_doc({"plain": _mode()})))
    b.write_text(json.dumps(_doc({"mma-v2": _mode(failed=["t::x"], rc=1)})))
    r = _run(tmp_path, "--merge", str(a), str(b), "--out", str(tmp_path / "m"))
    assert r.returncode == 1 and json.loads((tmp_path / "m" / f"{G.NAME}.json").read_text())["totals"]["failed"] == 1
    # a combined call whose second mode was cut off, then that mode again on its own
    both = tmp_path / "both.json"
    both.write_text(json.dumps(_doc({"plain": _mode(), "mma-v2": _mode(timed_out=True, rc=None)})))
    b.write_text(json.dumps(_doc({"mma-v2": _mode()})))
    r = _run(tmp_path, "--merge", f"{both}:plain", str(b), "--out", str(tmp_path / "m3"))
    m3 = json.loads((tmp_path / "m3" / f"{G.NAME}.json").read_text())
    assert r.returncode == 0 and m3["ok"] and not m3["modes"]["mma-v2"]["timed_out"], r.stdout
    r = _run(tmp_path, "--merge", f"{both}:nope", str(b), "--out", str(tmp_path / "m4"))
    assert r.returncode == 2 and "no mode(s) ['nope']" in r.stdout
    b.write_text(json.dumps(_doc({"mma-v2": _mode()}, commit="other")))
    r = _run(tmp_path, "--merge", str(a), str(b), "--out", str(tmp_path / "m2"))
    assert r.returncode == 2 and "different code" in r.stdout


def test_prepare_stages_the_library_xz_compressed_with_its_sha256(tmp_path):
    payload = bytes(range(256)) * 4096
    wheel = tmp_path / "vllm-9.9.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(G.PEER_LIBRARY, payload)
        z.writestr("vllm/__init__.py", "")
    sha = G.sha256_file(wheel)
    out = tmp_path / "carry"
    man = G.prepare("9.9.0", wheel, sha, "2.11.0", out=out, preset=0)
    e = man["pins"]["9.9.0"]
    assert lzma.decompress((out / e["path"]).read_bytes()) == payload
    assert e["sha256"] == __import__("hashlib").sha256(payload).hexdigest() and e["torch"] == "2.11.0"
    assert json.loads((out / "manifest.json").read_text()) == man
    with pytest.raises(SystemExit, match="sha256"):
        G.prepare("9.9.0", wheel, "0" * 64, "2.11.0", out=out, preset=0)


def test_peer_loader_reads_what_prepare_writes(tmp_path, monkeypatch):
    """tests/kernels/vllm_peers.py unpacks the staged file and checks it against the manifest."""
    sys.path.insert(0, str(G.REPO))
    from tests.kernels import vllm_peers

    payload = b"not really a library" * 1000
    wheel = tmp_path / "w.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(G.PEER_LIBRARY, payload)
    out = tmp_path / "carry"
    man = G.prepare("9.9.0", wheel, G.sha256_file(wheel), "2.11.0", out=out, preset=0)
    monkeypatch.setattr(vllm_peers, "CARRY", out)
    monkeypatch.setattr(vllm_peers, "MANIFEST", out / "manifest.json")
    monkeypatch.setattr(vllm_peers.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    lib = vllm_peers.unpacked(vllm_peers.manifest()["pins"]["9.9.0"])
    assert lib.read_bytes() == payload
    # a corrupted unpacked copy is caught and removed
    lib.write_bytes(b"x")
    with pytest.raises(vllm_peers.PeerMissing, match="sha256"):
        vllm_peers.unpacked(man["pins"]["9.9.0"])
    assert not lib.exists()


@pytest.mark.real_wheel
def test_stage_writer_cubin_finds_vllms_mla_writers_in_the_pinned_wheel(tmp_path):
    """From the cached 0.26.0 release wheel: the staged cubin holds the writer kernels the
    byte-equality test of tests/kernels/test_mla_kv_cache.py launches."""
    import tomllib

    pin = tomllib.loads((G.REPO / "pins.lock").read_text())["pins"]["0.26.0"]
    wheel = G.wheel_cache() / pin["wheel"]
    if not wheel.exists():
        pytest.skip(f"{wheel} not cached (python3 tools/apply.py fetch)")
    man = G.stage_writer_cubin("0.26.0", wheel, pin["sha256"], out=tmp_path)
    cubin = (tmp_path / man["cubins"]["0.26.0"]["path"]).read_bytes()
    assert b"concat_and_cache_ds_mla_kernel" in cubin and b"concat_and_cache_mla_kernel" in cubin


def test_without_a_gpu_the_run_is_not_evidence(tmp_path):
    """All @gpu tests would skip: the call fails (unless --allow-no-gpu), naming why."""
    suite = _project(tmp_path)
    r = _run(tmp_path, "--modes", "mma-v2", "--tests", str(suite), "--out", str(tmp_path / "o"),
             env_extra={"EXPECT_MMA_V3_OFF": "1", "CUDA_VISIBLE_DEVICES": ""})
    doc = json.loads((tmp_path / "o" / f"{G.NAME}.json").read_text())
    assert r.returncode == 1 and not doc["ok"] and doc["modes"]["mma-v2"]["ok"]
    assert doc["problems"] == ["no CUDA GPU visible to torch: the @gpu tests cannot run here"]


def test_shards_run_side_by_side_and_add_up_to_the_whole_suite(tmp_path):
    """--jobs 2 with both modes: four processes, each test run once per mode, logs kept, and a
    failure's text (assertion + traceback) recorded in the file."""
    suite = _project(tmp_path)
    (suite / "test_more.py").write_text("import pytest\n\n@pytest.mark.parametrize('i', range(5))\n"
                                        "def test_p(i):\n    assert i != 3, 'planted failure'\n")
    out, logs = tmp_path / "out", tmp_path / "logs"
    r = _run(tmp_path, "--modes", "plain,mma-v2", "--jobs", "2", "--tests", str(suite), "--out", str(out),
             "--logs", str(logs), "--allow-no-gpu", env_extra={"EXPECT_MMA_V3_OFF": "1"})
    assert r.returncode == 1, r.stdout[-3000:]
    doc = json.loads((out / f"{G.NAME}.json").read_text())
    mma, plain = doc["modes"]["mma-v2"], doc["modes"]["plain"]
    # mma-v2: 2 + 4 pass, 1 skip, the planted failure; plain also fails the env test
    assert mma["counts"]["passed"] == 6 and mma["counts"]["skipped"] == 1 and mma["counts"]["failed"] == 1
    assert plain["counts"]["passed"] == 5 and plain["counts"]["failed"] == 2
    assert [s["counts"]["passed"] + s["counts"]["failed"] + s["counts"]["skipped"] for s in mma["shards"]] == [4, 4]
    (nid,) = mma["failed"]
    assert nid.endswith("test_p[3]") and "planted failure" in mma["failure_details"][nid]
    assert "planted failure" in r.stdout
    assert sorted(p.name for p in logs.iterdir()) == ["mma-v2.0.log", "mma-v2.1.log", "plain.0.log", "plain.1.log"]


def test_a_shard_with_no_test_is_not_a_failure(tmp_path):
    d = tmp_path / "one"
    d.mkdir()
    (d / "test_one.py").write_text("def test_only():\n    pass\n")
    r = _run(tmp_path, "--modes", "plain", "--jobs", "3", "--tests", str(d), "--out", str(tmp_path / "o"),
             "--allow-no-gpu")
    doc = json.loads((tmp_path / "o" / f"{G.NAME}.json").read_text())
    assert r.returncode == 0 and doc["ok"] and doc["modes"]["plain"]["counts"]["passed"] == 1, r.stdout[-2000:]
