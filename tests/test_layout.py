"""The package lives under ``src/``: running Python from the folder that holds the clone
(whose directory is usually named ``torchloom`` too) imports the installed package, not
the clone's directory as an empty namespace package."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_import_from_the_folder_that_holds_the_clone(tmp_path: Path) -> None:
    (tmp_path / "torchloom").symlink_to(ROOT, target_is_directory=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, "-c", "import torchloom as tl; print(tl.__file__); tl.create_schedule"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert Path(proc.stdout.strip()).resolve() == ROOT / "src" / "torchloom" / "__init__.py"


def test_no_package_directory_at_the_repository_root() -> None:
    assert not (ROOT / "torchloom").exists()
    assert (ROOT / "src" / "torchloom" / "__init__.py").is_file()
