"""The versions torchloom declares, and that installing it keeps a user's torch.

* ``pyproject.toml`` declares ``torch>=2.11`` (no upper bound) and ``python>=3.11`` (no
  upper bound); the ``dev`` extra pins CI's torch, 2.13.0.
* ``pip install --dry-run -e .`` into an environment that holds another supported torch
  (2.11.0) installs torchloom only: the torch stays. ``-e ".[dev]"`` there picks 2.13.0,
  not the newest release offered (2.14.1). Offline and isolated from this machine's pip
  configuration: a virtual environment seeing the system packages, a metadata-only
  ``torch-2.11.0.dist-info`` shadowing the system torch, and metadata-only torch wheels
  in a local ``--find-links`` folder (pip decides from metadata alone).
* Every private torch API torchloom uses exists in the running torch
  (:mod:`torchloom.runtime.compat` lists them).
* Checkpoints no longer go through the deprecated ``ShardedTensor``: a TP=2 save and load
  of a fused (``chunks=3``) weight never constructs one and warns nothing about it, and
  DCP still records the full shape with one chunk per piece.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
import tomllib
import venv
import warnings
import zipfile
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from packaging.version import Version

from tests.dist import spawn

ROOT = Path(__file__).resolve().parent.parent
LOWEST_TORCH = Version("2.11")
CI_TORCH = "2.13.0"


def _project() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]


def _requirement(items: list[str], name: str) -> Requirement:
    found = [Requirement(r) for r in items if Requirement(r).name == name]
    assert len(found) == 1, (name, items)
    return found[0]


def test_pyproject_declares_the_supported_range() -> None:
    project = _project()
    python = project["requires-python"]
    assert python.replace(" ", "") == ">=3.11", python  # no upper cap
    torch_req = _requirement(project["dependencies"], "torch")
    assert str(torch_req.specifier) == f">={LOWEST_TORCH}", torch_req
    for version in ("2.10.0", "2.11.0", "2.13.0", "2.14.1", "3.0.0"):
        assert (Version(version) in torch_req.specifier) == (Version(version) >= LOWEST_TORCH)
    dev = _requirement(project["optional-dependencies"]["dev"], "torch")
    assert str(dev.specifier) == f"=={CI_TORCH}", dev
    assert Version(CI_TORCH) in torch_req.specifier


def test_running_torch_is_in_the_declared_range() -> None:
    assert Version(Version(torch.__version__).base_version) >= LOWEST_TORCH


@pytest.mark.parametrize("module, names", [
    ("torch.distributed.pipelining.schedules",
     ["_Action", "_ComputationType", "_simulate_comms_compute", "_validate_schedule"]),
    ("torch.serialization", ["_get_layout"]),
    ("torch._subclasses.fake_tensor", ["FakeTensorMode", "is_fake"]),
    ("torch.testing._internal.distributed.fake_pg", ["FakeStore"]),
    ("torch.distributed.checkpoint.planner_helpers", ["create_read_items_for_chunk_list"]),
])
def test_private_torch_apis_exist(module: str, names: list[str]) -> None:
    mod = importlib.import_module(module)
    missing = [n for n in names if not hasattr(mod, n)]
    assert not missing, f"torch {torch.__version__} lacks {module}.{missing}"


# --------------------------------------------------------------------------- pip


def _metadata(name: str, version: str) -> str:
    return f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"


def _fake_wheel(folder: Path, name: str, version: str) -> None:
    info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(folder / f"{name}-{version}-py3-none-any.whl", "w") as z:
        z.writestr(f"{info}/METADATA", _metadata(name, version))
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: torchloom-tests\n"
                   "Root-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", f"{info}/METADATA,,\n{info}/WHEEL,,\n{info}/RECORD,,\n")


@pytest.fixture(scope="module")
def torch_211_env(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A virtual environment seeing the system packages in which torch 2.11.0 is installed
    (metadata only), and a folder of torch wheels 2.11.0, 2.13.0, 2.14.1 (metadata only)."""
    root = tmp_path_factory.mktemp("pip")
    env = root / "venv"
    venv.EnvBuilder(system_site_packages=True, with_pip=False).create(env)
    python = env / "bin" / "python"
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True).stdout.strip()
    info = Path(site) / "torch-2.11.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(_metadata("torch", "2.11.0"))
    (info / "INSTALLER").write_text("pip\n")
    (info / "RECORD").write_text("")
    wheels = root / "wheels"
    wheels.mkdir()
    for version in ("2.11.0", CI_TORCH, "2.14.1"):
        _fake_wheel(wheels, "torch", version)
    seen = subprocess.run(
        [python, "-c", "import importlib.metadata as m; print(m.version('torch'))"],
        capture_output=True, text=True, check=True).stdout.strip()
    assert seen == "2.11.0", seen
    return python, wheels


def _dry_run(python: Path, wheels: Path, target: str, report: Path) -> list[tuple[str, str]]:
    """What ``pip install --dry-run -e target`` would install into ``python``'s
    environment: [(name, version)], offline, without this machine's pip configuration."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--dry-run",
         "--no-index", "--find-links", str(wheels), "--no-build-isolation", "--quiet",
         "--report", str(report), "-e", target],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    if proc.returncode != 0 and "no such option: --python" in proc.stderr:
        pytest.skip("pip older than 22.3 (no --python)")
    if proc.returncode != 0 and "invalid command 'bdist_wheel'" in proc.stderr:
        pytest.skip("this environment's setuptools cannot build wheels (< 70.1, no wheel)")
    assert proc.returncode == 0, proc.stderr[-3000:]
    installs = json.loads(report.read_text())["install"]
    return sorted((i["metadata"]["name"], i["metadata"]["version"]) for i in installs)


def test_pip_install_keeps_another_supported_torch(torch_211_env, tmp_path: Path) -> None:
    python, wheels = torch_211_env
    assert _dry_run(python, wheels, ".", tmp_path / "plain.json") == [("torchloom", "0.1.0")]


def test_pip_install_dev_pins_the_ci_torch(torch_211_env, tmp_path: Path) -> None:
    python, wheels = torch_211_env
    assert _dry_run(python, wheels, ".[dev]", tmp_path / "dev.json") == [
        ("torch", CI_TORCH), ("torchloom", "0.1.0")]


# --------------------------------------------------------------------------- checkpoints


def _no_sharded_tensor_check(rank: int) -> None:
    import tempfile

    import torch.distributed as dist
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    import torchloom as tl

    def refuse(*args, **kwargs):
        raise AssertionError("a ShardedTensor was constructed")

    ShardedTensor._init_from_local_shards_and_global_metadata = classmethod(refuse)
    ShardedTensor._init_from_local_tensor = classmethod(refuse)

    def model(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        m = torch.nn.Sequential(torch.nn.Linear(4, 12))
        sch = tl.create_schedule(m)
        sch["0"].shard("weight", 0, chunks=3)   # rank r: rows [q_r | k_r | v_r]
        sch["0"].shard("bias", 0, chunks=3)
        return tl.build(sch)[0]

    folder = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(folder)
    path = os.path.join(folder[0], "run")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        saved = model(0)
        opt = torch.optim.AdamW(saved.parameters(), lr=0.1)
        saved(torch.ones(2, 4)).sum().backward()
        opt.step()
        tl.save(saved, opt, path, step=1)
        loaded = model(1)
        loaded_opt = torch.optim.AdamW(loaded.parameters(), lr=0.5)
        assert tl.load(loaded, loaded_opt, path) == 1
    said = [str(w.message) for w in caught if "ShardedTensor" in str(w.message)]
    assert not said, said
    for a, b in zip(saved.parameters(), loaded.parameters(), strict=True):
        assert torch.equal(a, b)
        assert torch.equal(opt.state[a]["exp_avg"], loaded_opt.state[b]["exp_avg"])
    if rank == 0:
        from torch.distributed.checkpoint import FileSystemReader

        md = FileSystemReader(os.path.join(path, "step-1")).read_metadata().state_dict_metadata
        weight = md["model.0.weight"]
        assert tuple(weight.size) == (12, 4)
        assert sorted(tuple(c.offsets) for c in weight.chunks) == [(2 * i, 0) for i in range(6)]
    dist.barrier()
    if rank == 0:
        shutil.rmtree(folder[0])


def test_checkpoints_do_not_construct_sharded_tensors() -> None:
    spawn(_no_sharded_tensor_check)
