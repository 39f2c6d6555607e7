"""scripts/gpu_check.py and gpu_check.sh (docs/gpu_check.md): the wheel closure, the travel budget, weights
in parts, and the script's sections at toy sizes on CPU."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check.py"


def _load():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gc = _load()

FAKE = {  # name -> Requires-Dist lines: a small world with every case the resolver meets
    "glance-rt": ["torch==2.13.0", "transformers>=5.20", "tokenizers>=0.20", "numpy>=1.26",
                  'gguf>=0.10; extra == "gguf"', 'onnx>=1.17; extra == "onnx"'],
    "transformers": ["huggingface-hub>=2.4", "tokenizers<0.24,>=0.23.1", "safetensors>=0.9", "typer", "regex"],
    "huggingface-hub": ['hf-xet>=1.6; platform_machine == "x86_64"', "httpx2>=2", 'tomli; python_version < "3.11"'],
    "httpx2": ["anyio>=4.10", 'pytest; extra == "testing"'],
    "tokenizers": ["huggingface-hub>=0.16", "onlytok"],  # onlytok: needed by an excluded package alone
    "safetensors": [], "regex": [], "anyio": [], "gguf": ["numpy>=1.17"], "onlytok": [], "hf-xet": [],
    "torch": ["nvidia-cublas", "sympy"], "typer": ["pydantic"],
}


def fake_plan(**image):
    versions = {n: "1.0" for n in FAKE}
    old = dict(gc.IMAGE_VERSIONS)
    gc.IMAGE_VERSIONS.clear()
    gc.IMAGE_VERSIONS.update(image)
    try:
        return gc.wheel_plan(requires=lambda n: FAKE.get(n, []), version=versions.__getitem__)
    finally:
        gc.IMAGE_VERSIONS.clear()
        gc.IMAGE_VERSIONS.update(old)


def test_closure_carries_what_the_image_lacks():
    carried, excluded = fake_plan(numpy="2.5.2", tokenizers="0.23.2", safetensors="0.8.0")
    assert sorted(carried) == ["anyio", "gguf", "httpx2", "huggingface-hub", "regex", "safetensors", "transformers"]
    assert excluded["torch"] == "the image's CUDA torch stack" and excluded["typer"].startswith("on the image")
    assert excluded["tokenizers"] == "on the image at 0.23.2"  # fits >=0.20 and <0.24,>=0.23.1
    assert excluded["hf-xet"].startswith("optional")
    assert "onlytok" not in carried  # only the image's tokenizers needs it
    assert not {"tomli", "pytest", "onnx", "pydantic", "sympy", "nvidia-cublas"} & (set(carried) | set(excluded))


def test_closure_carries_an_image_package_that_is_too_old():
    carried, excluded = fake_plan(numpy="2.5.2", tokenizers="0.22.0", safetensors="0.9.1")
    assert "tokenizers" in carried and "onlytok" in carried and "safetensors" in excluded


def test_closure_of_this_venv():
    carried, excluded = gc.wheel_plan()
    assert {"transformers", "huggingface-hub", "regex", "httpx2", "click", "num2words", "docopt"} <= set(carried)
    assert {"torch", "numpy", "kernels", "hf-xet"} <= set(excluded)
    assert not any(n.startswith(("nvidia-", "torch", "triton")) for n in carried)


def test_size_check():
    assert gc.check_size(41 * 2**20, 18 * 2**20).startswith("travels: tree 41.0 MiB + .gpu 18.0 MiB = 59.0 MiB")
    with pytest.raises(SystemExit, match="over the 60 MiB budget"):
        gc.check_size(41 * 2**20, 20 * 2**20)


def test_tree_bytes_counts_what_travels(tmp_path):
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], cwd=tmp_path, check=True)
    (tmp_path / ".gitignore").write_text("/.gpu/\n")
    (tmp_path / "a.txt").write_bytes(b"x" * 1000)
    subprocess.run([*git, "add", "a.txt", ".gitignore"], cwd=tmp_path, check=True)
    (tmp_path / "new.txt").write_bytes(b"y" * 300)  # untracked, not ignored: travels too
    (tmp_path / ".gpu").mkdir()
    (tmp_path / ".gpu" / "w.whl").write_bytes(b"z" * 5000)  # ignored: counted as .gpu, not the tree
    assert gc.tree_bytes(tmp_path) == 1000 + 300 + len("/.gpu/\n")
    assert gc.folder_bytes(tmp_path / ".gpu") == 5000
    (tmp_path / ".gpu" / "parts").mkdir()
    (tmp_path / ".gpu" / "parts" / "m.part000").write_bytes(b"p" * 700)  # travel one call at a time
    assert gc.folder_bytes(tmp_path / ".gpu") == 5000


def test_split_stage_assemble(tmp_path):
    blob = os.urandom(2500)
    (tmp_path / "model.gguf").write_bytes(blob)
    parts = tmp_path / "parts"
    m = gc.split_file(tmp_path / "model.gguf", parts, part_bytes=1000)
    assert [p["file"] for p in m["parts"]] == [f"model.gguf.part{i:03d}" for i in range(3)]
    stage = tmp_path / "stage"
    for i, call in enumerate((["part000", "manifest.json"], ["part001"], ["part002"])):  # one call each
        carried = tmp_path / f"call{i}"
        carried.mkdir()
        for suffix in call:
            shutil.copy(parts / f"model.gguf.{suffix}", carried)
        gc.stage_parts(carried, stage)
        done = gc.assemble(stage)["model.gguf"]
        assert done.startswith("missing") if i < 2 else Path(done).read_bytes() == blob
    (stage / "model.gguf").unlink()
    (stage / "model.gguf.part001").write_bytes(b"corrupt")
    assert gc.assemble(stage)["model.gguf"] == "missing or corrupt parts: model.gguf.part001"


def run_script(*args, timeout=600):
    out = subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def test_plan_prints_the_wheels(tmp_path):
    lines = run_script("--plan", str(tmp_path / "plan.json"), timeout=120).split()
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert lines == [f"{n}=={v}" for n, v in plan["carried"].items()] and "transformers" in plan["carried"]


@pytest.mark.extended  # 2 min: the script's other sections and its pieces stay in CI's tier
def test_cpu_gpu_tests_real_and_numerics_sections(tmp_path):
    """gpu_tests runs `pytest -m gpu` from a copy of tests/ (here: collected, skipped); real is skipped
    cleanly without --target; numerics counts verify rows and GLANCE runs equal to AR, fast and exact
    (exact: all of them)."""
    run_script("--cpu", "--out", str(tmp_path), "--sections", "gpu_tests,real,numerics", timeout=400)
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    nu = report["numerics"]
    assert nu["tokens_equal_ar_exact"] == "8/8" and nu["rows"]["qwen2_5_vl/bfloat16/exact"] == "11/11"
    assert set(nu["tokens"]) == {f"qwen2_5_vl/{d}/{n}" for d in ("bfloat16", "float16") for n in ("fast", "exact")}
    assert report["gpu_tests"]["status"] == "passed" and "skipped" in report["gpu_tests"]["summary"]
    assert "tests/test_passes.py" in report["gpu_tests"]["files"]
    assert report["real"] == {"status": "not run: no --target"}
    assert report["env"]["unmet"] == []


@pytest.mark.full
@pytest.mark.extended  # 5 min: each section's parts are tested on their own in CI's tier
def test_cpu_run_of_every_section(tmp_path):
    """`gpu_check.py --cpu`: every section at toy sizes (the script itself), in a few minutes."""
    run_script("--cpu", "--out", str(tmp_path), "--compile-archs", "llama", "--budgets", "4",
               "--spare-budgets", "8", "--deadline", "800", timeout=900)  # time for the exact timings too
    r = json.loads((tmp_path / "gpu_check.json").read_text())
    assert r["lossless"]["all_equal_hf"] and r["lossless"]["no_recompiles"]
    assert r["kernel"]["batched_call_equals_each_sequence"] is True
    assert r["kernel"]["path_rows_equal_their_ar_steps"] == {"float32": "62/62"}
    toy = r["timings"]["toy"]
    assert {"ar_step_ms", "draft_ms", "verify_4_ms", "round_4_ms", "verify_8_ms"} <= set(toy["compile"])  # 8: spare
    assert {"device_step_ms", "device_round_4_ms", "device_round_8_ms"} <= set(toy["compile"])  # --cpu: on device too
    assert {"ar_step", "device_step", "draft", "verify_8", "round_8"} <= set(toy["profile"]) and toy["profile"]["draft"]
    assert toy["hf_static"]["step_ms"] > 0 and {"hf_static/ar_step", "hf_static/device_step"} <= set(toy["ratios"])
    ab = toy["ar_step_ms_by_cuda_graphs"]  # on CPU both are plain compiled passes (the code checked)
    assert toy["cuda_graphs"] == "runner" and set(ab) == {"runner", "trees"}
    assert all(isinstance(v, float) for v in ab.values())
    assert {"ar_step_ms", "verify_8_ms", "round_8_ms"} <= set(toy["compile_exact"])  # issue 39's cost, at the
    assert "exact/fast round_8" in toy["ratios"]  # largest budget timed
    assert r["batch"]["batch_8"]["tok_s"] > 0 and "speedup" in r["batch"] and "same_tokens" in r["batch"]


def _pypi_reachable() -> bool:
    probe = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", "/tmp/glance-probe",
                            "docopt==0.6.2"], capture_output=True, timeout=120)
    return probe.returncode == 0


@pytest.mark.full
@pytest.mark.extended  # 1 min: the closure's contents and the travel budget stay in CI's tier
def test_closure_imports_on_a_stand_in_of_the_image():
    """`gpu_check.sh --check-closure`: the carried wheels, --no-index over a Python 3.12 venv with the
    image's torch 2.11 and pins, import transformers and glance_rt and run a toy lossless sweep."""
    if shutil.which("git") is None or not _pypi_reachable():
        pytest.skip("needs PyPI (the wheels and the image's torch are downloaded)")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "GLANCE_TEST_TOKENIZER")}
    out = subprocess.run(["bash", "scripts/gpu_check.sh", "--check-closure"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=1800)
    if out.returncode != 0 and "no Python 3.12" in out.stderr:
        pytest.skip("needs a Python 3.12 (the image's) to build the stand-in")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "closure OK" in out.stdout
