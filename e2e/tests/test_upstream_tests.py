"""e2e/upstream_tests.py without a GPU: reading pytest's results per backend, the run on a bundle
(a fake test module with the upstream test's name and backend ids; pytest really runs), the exit
status, the carried wheels (installed only where the host lacks their modules), the Hugging Face
config stand-in, merging, and the README line."""
from __future__ import annotations

import base64
import hashlib
import json
import re
import sys
import zipfile
from pathlib import Path

import pytest

import upstream_tests as U

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.v1.attention.test_sparse_mla_backends" name="test_sparse_backend_decode_correctness[1.0-1.0-64-1-auto-mixed_small-TritonMLASparse]"/>
<testcase classname="tests.v1.attention.test_sparse_mla_backends" name="test_sparse_backend_decode_correctness[1.0-1.0-64-1-fp8-mixed_small-TritonMLASparse]"><failure message="AssertionError: Tensor-likes are not close!">trace</failure></testcase>
<testcase classname="tests.v1.attention.test_sparse_mla_backends" name="test_sparse_backend_decode_correctness[1.0-1.0-32-1-auto-mixed_small-TritonMLASparse]"><skipped type="pytest.skip" message="TRITON_MLA_SPARSE does not support block_size=32">s</skipped></testcase>
<testcase classname="tests.v1.attention.test_sparse_mla_backends" name="test_sparse_backend_decode_correctness[1.0-1.0-64-1-auto-mixed_small-FlashMLA]"/>
<testcase classname="tests.v1.attention.test_sparse_mla_backends" name="test_sparse_backend_decode_correctness[1.0-1.0-64-1-auto-mixed_small-FlashInferTRTLLM]"><skipped type="pytest.skip" message="FlashInferMLASparseTRTLLMBackend requires SM 10.x capability">s</skipped></testcase>
<testcase classname="tests.v1.attention.test_sparse_mla_backends" name="test_sparse_backend_decode_correctness[1.0-1.0-64-1-auto-mixed_small-FlashMLA2]"><error message="boom">e</error></testcase>
</testsuite></testsuites>"""


def test_results_per_backend_from_junit():
    cases = U.parse_junit_cases(JUNIT)
    assert cases[0]["id"] == ("tests/v1/attention/test_sparse_mla_backends.py::test_sparse_backend_decode_correctness"
                              "[1.0-1.0-64-1-auto-mixed_small-TritonMLASparse]")
    b = U.by_backend(cases)
    assert list(b) == ["FlashMLA", "FlashInferTRTLLM", "TritonMLASparse", "other"]
    t = b["TritonMLASparse"]
    assert t["counts"] == {"passed": 1, "failed": 1, "error": 0, "skipped": 1, "xfailed": 0, "xpassed": 0}
    assert t["failed"] == [cases[1]["id"]] and "not close" in t["failure_details"][cases[1]["id"]]
    assert t["skip_reasons"] == {"TRITON_MLA_SPARSE does not support block_size=32": 1}
    assert b["FlashInferTRTLLM"]["counts"]["skipped"] == 1
    assert b["other"]["errors"] == [cases[5]["id"]]  # an id that is not one of the test's backends


def test_results_from_verbose_lines_of_a_cut_off_run():
    text = ("tests/v1/attention/test_sparse_mla_backends.py::test_sparse_backend_decode_correctness[1.0-1.0-64-1-auto-x-FlashMLA] PASSED [ 1%]\n"
            "tests/v1/attention/test_sparse_mla_backends.py::test_sparse_backend_decode_correctness[1.0-1.0-64-1-auto-x-TritonMLASparse] FAILED [ 2%]\n"
            "tests/v1/attention/test_sparse_mla_backends.py::test_sparse_backend_decode_correctness[1.0-1.0-64-2-auto-x-TritonMLASparse] ")
    b = U.by_backend(U.parse_verbose_cases(text))
    assert b["FlashMLA"]["counts"]["passed"] == 1 and b["TritonMLASparse"]["counts"]["failed"] == 1


FAKE_TEST = '''
import pytest


class B:
    pass


class FlashMLA(B):
    pass


class TritonMLASparse(B):
    pass


@pytest.mark.parametrize("backend_cls", [FlashMLA, TritonMLASparse], ids=["FlashMLA", "TritonMLASparse"])
@pytest.mark.parametrize("block_size", [32, 64])
def test_sparse_backend_decode_correctness(backend_cls, block_size):
    if block_size == 32:
        pytest.skip("does not support block_size=32")
    assert not ({fail} and backend_cls is TritonMLASparse), "Tensor-likes are not close!"


def test_other_thing():
    raise AssertionError("not selected")
'''


def _bundle(tmp_path: Path, fail: bool) -> Path:
    b = tmp_path / "bundle"
    (b / "tests" / "v1" / "attention").mkdir(parents=True)
    (b / "tests" / "__init__.py").write_text("")
    (b / "tests" / "v1" / "attention" / "test_sparse_mla_backends.py").write_text(FAKE_TEST.replace("{fail}", str(fail)))
    (b / "upstream-tests.json").write_text(json.dumps({"vllm": "0.26.0", "sdist_sha256": "ab" * 32, "patches": ["0001-x.patch"]}))
    return b


@pytest.fixture
def fake_host(tmp_path, monkeypatch):
    """No staged vLLM, no carried wheels, the stand-in cache under tmp_path, the preflight on pytest only."""
    monkeypatch.setattr(U, "PREFLIGHT", ["pytest"])
    monkeypatch.setattr(U, "WHEELS", tmp_path / "no-wheels")
    monkeypatch.setattr(U, "HF_STAND_IN", tmp_path / "hf" / "hub")
    monkeypatch.setattr(U, "DEPS_SITE", tmp_path / "deps-site")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    return tmp_path


@pytest.mark.parametrize("fail", [False, True])
def test_run_counts_each_backend_and_fails_on_a_failure(fake_host, capsys, fail):
    tmp = fake_host
    out = tmp / "out"
    rc = U.main(["--bundle", str(_bundle(tmp, fail)), "--site", str(tmp / "site"), "--no-sync-overlay",
                 "--allow-no-gpu", "--jobs", "2", "--out", str(out), "--commit", "abc1234"])
    doc = json.loads((out / f"{U.NAME}.json").read_text())
    assert rc == (1 if fail else 0) and doc["ok"] is (not fail)
    assert doc["selection"] == U.TEST_NAME  # every backend of the list runs
    assert doc["backends"]["FlashMLA"]["counts"]["passed"] == 1
    assert doc["backends"]["FlashMLA"]["counts"]["skipped"] == 1
    ours = doc["backends"]["TritonMLASparse"]["counts"]
    assert (ours["passed"], ours["failed"], ours["skipped"]) == ((0, 1, 1) if fail else (1, 0, 1))
    assert "other" not in doc["backends"]  # test_other_thing is not selected
    assert doc["commit"] == "abc1234" and doc["bundle"]["vllm"] == "0.26.0"
    assert doc["model_config"]["source"].startswith("stand-in")
    assert "-k test_sparse_backend_decode_correctness" in doc["pytest_command"]
    text = capsys.readouterr().out.rstrip().splitlines()
    assert re.match(r"total\s+%d\s+%d\s+0\s+2$" % (2 - fail, fail), text[-1])  # the table comes last
    assert text[-4].split()[:1] == ["backend"]


def test_run_without_a_bundle_is_a_usage_error(fake_host):
    assert U.main(["--bundle", str(fake_host / "nothing"), "--allow-no-gpu"]) == 2


def test_run_fails_when_nothing_ran_or_no_gpu(fake_host):
    tmp = fake_host
    b = _bundle(tmp, False)
    out = tmp / "out"
    rc = U.main(["--bundle", str(b), "--site", str(tmp / "site"), "--no-sync-overlay", "--jobs", "1",
                 "--out", str(out), "--commit", "abc", "--backends", "FlashInferTRTLLM"])
    doc = json.loads((out / f"{U.NAME}.json").read_text())
    assert rc == 1 and not doc["ok"]  # no test of that backend, and (here) no GPU
    assert "FlashInferTRTLLM" in doc["selection"]


def _wheel(d: Path, name: str, modules: list[str], top_level: bool = True) -> Path:
    info = f"{name}-1.0.dist-info"
    content = {f"{m}/__init__.py": b"X = 1\n" for m in modules}
    content[f"{info}/METADATA"] = f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n".encode()
    content[f"{info}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: t\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    if top_level:
        content[f"{info}/top_level.txt"] = "".join(m + "\n" for m in modules).encode()
    b64 = lambda v: base64.urlsafe_b64encode(hashlib.sha256(v).digest()).rstrip(b"=").decode()  # noqa: E731
    record = "".join(f"{k},sha256={b64(v)},{len(v)}\n" for k, v in content.items()) + f"{info}/RECORD,,\n"
    p = d / f"{name}-1.0-py3-none-any.whl"
    d.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(p, "w") as z:
        for k, v in content.items():
            z.writestr(k, v)
        z.writestr(f"{info}/RECORD", record)
    return p


def test_carried_wheels_install_only_what_the_host_lacks(tmp_path):
    w = tmp_path / "wheels"
    _wheel(w, "json_shadow", ["json"])  # the host has json: never shadowed
    _wheel(w, "glm5_missing_pkg", ["glm5_missing_pkg"], top_level=False)
    assert U.wheel_modules(w / "glm5_missing_pkg-1.0-py3-none-any.whl") == ["glm5_missing_pkg"]
    site = tmp_path / "site"
    res = U.install_missing_wheels(dict(__import__("os").environ), w, site)
    assert res["installed"] == ["glm5_missing_pkg-1.0-py3-none-any.whl"] and "error" not in res
    assert (site / "glm5_missing_pkg" / "__init__.py").is_file() and not (site / "json").exists()


def test_model_config_stand_in_only_without_the_hosts_cache(tmp_path):
    env = {"HF_HUB_CACHE": str(tmp_path / "host")}
    src = U.model_config_source(env, tmp_path / "ours")
    assert src["source"].startswith("stand-in") and env["HF_HUB_CACHE"] == str(tmp_path / "ours")
    cfg = json.loads(Path(src["path"]).read_text())
    assert cfg["model_type"] == "deepseek_v2" and cfg["kv_lora_rank"] == 512
    snap = tmp_path / "host" / "models--deepseek-ai--DeepSeek-V2-Lite-Chat" / "snapshots" / "r1"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    env = {"HF_HUB_CACHE": str(tmp_path / "host")}
    assert U.model_config_source(env, tmp_path / "ours2")["source"] == "host hub cache"
    assert env["HF_HUB_CACHE"] == str(tmp_path / "host")


def _doc(backends: dict, commit="c1", gpu="NVIDIA H200") -> dict:
    d = {"name": U.NAME, "command": "x", "commit": commit, "vllm": "0.26.0", "bundle": {"sdist_sha256": "a"},
         "tree_sha256": {"overlay": "o"}, "environment": {"gpu": gpu, "torch": "2.11.0", "triton": "3.6.0"},
         "backends": {b: {"counts": dict(dict.fromkeys(U.COUNT_KEYS, 0), **c), "failed": [], "errors": [],
                          "failure_details": {}, "skip_reasons": {}} for b, c in backends.items()},
         "problems": []}
    return U.summarize(d)


def test_merge_combines_backends_of_one_commit(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(_doc({"TritonMLASparse": {"passed": 3, "skipped": 1}})))
    b.write_text(json.dumps(_doc({"FlashMLA": {"passed": 2}, "FlashInferTRTLLM": {"skipped": 5}})))
    assert U.main(["--merge", str(a), str(b), "--out", str(tmp_path / "r")]) == 0
    doc = json.loads((tmp_path / "r" / f"{U.NAME}.json").read_text())
    assert list(doc["backends"]) == ["FlashMLA", "FlashInferTRTLLM", "TritonMLASparse"]
    assert doc["totals"]["passed"] == 5 and doc["ok"]
    b.write_text(json.dumps(_doc({"TritonMLASparse": {"passed": 1}})))
    assert U.main(["--merge", str(a), str(b), "--out", str(tmp_path / "r")]) == 2  # a backend twice
    b.write_text(json.dumps(_doc({"FlashMLA": {"passed": 1}}, commit="c2")))
    assert U.main(["--merge", str(a), str(b), "--out", str(tmp_path / "r")]) == 2  # other code
    b.write_text(json.dumps(_doc({"FlashMLA": {"failed": 1}})))
    assert U.main(["--merge", str(a), str(b), "--out", str(tmp_path / "r")]) == 1  # a failure: not ok


def test_merge_replaces_a_backend_of_a_stopped_run_by_a_finished_one(tmp_path):
    """A run stopped at its deadline (all backends, some unfinished) and a re-run of one backend
    that finished: that backend comes from the re-run; the others stay marked incomplete, the
    merge stays timed out (not ok) and says which; two finished runs of a backend are refused."""
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    stopped = _doc({"FlashMLA": {"passed": 2, "skipped": 3}, "TritonMLASparse": {"passed": 1}})
    stopped.update(timed_out=True, problems=["stopped at --deadline-s 300: the tests that had not finished are "
                                             "not counted"])
    a.write_text(json.dumps(U.summarize(stopped)))
    b.write_text(json.dumps(_doc({"TritonMLASparse": {"passed": 4, "skipped": 4}})))
    assert U.main(["--merge", str(a), str(b), "--out", str(tmp_path / "r")]) == 1  # FlashMLA incomplete: not ok
    doc = json.loads((tmp_path / "r" / f"{U.NAME}.json").read_text())
    assert doc["backends"]["TritonMLASparse"]["counts"]["passed"] == 4 and doc["backends"]["TritonMLASparse"]["complete"]
    assert not doc["backends"]["FlashMLA"]["complete"] and doc["timed_out"] and not doc["ok"]
    assert doc["problems"] == ["stopped at a deadline, not re-run: FlashMLA (counts are of the tests that finished)"]
    assert U.main(["--merge", str(b), str(b), "--out", str(tmp_path / "r")]) == 2  # finished twice
    assert U.main(["--merge", str(b), str(a), "--out", str(tmp_path / "r")]) == 2  # stopped after finished


def test_deps_list_names_each_wheel_once_with_a_version():
    deps = U.read_deps()
    names = [re.split(r"==", d)[0].lower() for d in deps]
    assert all("==" in d for d in deps) and len(names) == len(set(names))
    assert {"tblib", "anthropic", "pytest"} <= set(names)


def test_script_help_runs_standalone():
    import subprocess

    r = subprocess.run([sys.executable, str(Path(U.__file__)), "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "--prepare" in r.stdout
