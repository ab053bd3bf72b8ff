"""The machinery on the real pinned release wheels (downloaded once into the wheel cache).

One baseline repository per pin is made per session (`real_tree`), without the compiled files
(patches never touch them); tools/run_tests.py builds, installs and verifies the full patched
wheels of every pin after this suite.
"""
from __future__ import annotations

import subprocess
import sys
import tomllib

import pytest

from conftest import REPO, TOOL

pytestmark = pytest.mark.real_wheel
# every pin of pins.lock, oldest first
PINS = sorted(tomllib.loads((REPO / "pins.lock").read_text())["pins"],
              key=lambda v: tuple(int(x) for x in v.split(".")))


@pytest.fixture(scope="session")
def project():
    from overlay_tool.project import Project

    return Project(REPO)


@pytest.fixture(scope="session")
def wheels(project):
    from overlay_tool.fetch import cached_wheel
    from overlay_tool.project import default_cache_dir

    out = {}
    for v in PINS:
        # downloads once if absent; verifies sha256 every time
        r = subprocess.run([sys.executable, str(TOOL), "--vllm", v, "fetch"], capture_output=True, text=True)
        assert r.returncode == 0, r.stdout + r.stderr
        out[v] = cached_wheel(project.pin(v), default_cache_dir())
    return out


@pytest.fixture(scope="session")
def real_tree(project, wheels, tmp_path_factory):
    from overlay_tool.tree import Tree, create_baseline

    cache = {}

    def get(v):
        if v not in cache:
            d = tmp_path_factory.mktemp(f"real-{v}") / "tree"
            create_baseline(d, project.pin(v), wheels[v], checkout=False, binaries=False)
            cache[v] = Tree.open(d, project.pin(v), managed=True)
        return cache[v]

    return get


@pytest.mark.parametrize("version", PINS)
def test_check_passes_for_every_pin(project, wheels, version):
    from overlay_tool.ops import check

    assert check(project, project.pin(version), wheels[version], print) == []


def test_first_0_26_patch_changes_exactly_the_routing_files(project, real_tree):
    from overlay_tool.patches import load_series

    t = real_tree("0.26.0")
    patches = load_series(project.patches_dir(t.pin))
    assert patches and patches[0].header.concern == "attention-routing"
    sim = t.simulate(t.base, patches[:1], None)
    assert sim.patches[0].status == "applied" and sim.patches[0].offsets == []
    changed = t.changed_paths(t.base, sim.commit)
    assert changed == {
        "vllm/v1/attention/backend.py": "M",
        "vllm/model_executor/layers/attention/mla_attention.py": "M",
        "vllm/v1/attention/backends/mla/flashinfer_mla_sparse_sm120.py": "M",
    }
    show = lambda path: t.g.out("show", f"{sim.commit}:{path}")  # noqa: E731
    assert "    supports_dense_mha_prefill = False\n" in show("vllm/v1/attention/backends/mla/flashinfer_mla_sparse_sm120.py") + "\n"
    assert "supports_dense_mha_prefill: bool = True" in show("vllm/v1/attention/backend.py")
    mla = show("vllm/model_executor/layers/attention/mla_attention.py")
    assert "if self.impl.is_sparse and not self.impl.supports_dense_mha_prefill:" in mla
    # the patch is what 0.33.0 does: the same flag exists there upstream
    t33 = real_tree("0.33.0")
    assert "supports_dense_mha_prefill = False" in t33.g.out("show", f"{t33.base}:vllm/v1/attention/backends/mla/flashinfer_mla_sparse_sm120.py")
    # applying it again counts as already applied (reverse-applies)
    again = t.simulate(sim.commit, patches[:1], None)
    assert again.patches[0].status == "already-applied" and not again.changed


def test_kernel_and_overlay_names_do_not_clash_with_any_pin(project, real_tree):
    overlay = project.overlay_files()
    for v in PINS:
        t = real_tree(v)
        upstream = set(t.g.out("ls-tree", "-r", "--name-only", t.base).splitlines())
        assert not [f.dest for f in overlay if f.dest in upstream], v


def test_baseline_is_the_release_content(project, wheels, real_tree):
    import zipfile

    from overlay_tool.tree import COMPILED_RE

    t = real_tree("0.26.0")
    tracked = set(t.g.out("ls-tree", "-r", "--name-only", t.base).splitlines())
    with zipfile.ZipFile(wheels["0.26.0"]) as zf:
        names = {n for n in zf.namelist() if not n.endswith("/") and not COMPILED_RE.search(n)}
        assert tracked == names
        for name in ("vllm/model_executor/layers/attention/mla_attention.py", "vllm-0.26.0.dist-info/METADATA"):
            assert t.g.run("show", f"{t.base}:{name}").stdout == zf.read(name)


@pytest.mark.parametrize("version", PINS)
def test_indexer_series_does_not_reference_the_backend_module(project, wheels, version, tmp_path):
    """The triton-dsa-indexer PR (export-pr) is ordinary vLLM code on its own: none of its
    patches, files, tests or PR.md import or name the overlay backend module
    (vllm/v1/attention/backends/mla/triton_mla_sparse.py, its compat table); its routing lives in
    code of its own (the kernel_config field, the resolver under vllm/v1/attention/ops/, the
    metadata field), which the series carries."""
    import re

    from overlay_tool.ops import export_pr

    out = tmp_path / "prs"
    export_pr(project, project.pin(version), wheels[version], out, "triton-dsa-indexer",
              "A <a@b.c>", False, False, log=lambda *a: None)
    files = sorted((out / "triton-dsa-indexer").iterdir())
    assert any(f.suffix == ".patch" for f in files) and (out / "triton-dsa-indexer" / "PR.md") in files
    text = "\n".join(f.read_text() for f in files)
    assert not re.search(r"triton_mla_sparse", text), [
        line for line in text.splitlines() if "triton_mla_sparse" in line]
    assert "+++ b/vllm/v1/attention/ops/sparse_indexer_backend.py" in text
    assert "+    sparse_indexer_backend: SparseIndexerBackend = \"auto\"" in text
    assert "+    indexer_backend: str = \"deep_gemm\"" in text  # the metadata field
    assert "static_forward_context" not in "\n".join(
        line for line in text.splitlines() if line.startswith("+"))
