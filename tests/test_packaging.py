"""The wheel ships every package and the whole Hydra config; installed, the CLI runs from any directory."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "-q", "-w", str(out)],
        check=True,
        timeout=240,
        capture_output=True,
    )
    (whl,) = out.glob("lightning_sync-*.whl")
    return whl


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_wheel_contains_every_package_and_config(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    packages = {p.parent.relative_to(ROOT).as_posix() for p in (ROOT / "lightning_sync").rglob("__init__.py")}
    missing = sorted(p for p in packages if f"{p}/__init__.py" not in names)
    assert not missing, f"packages missing from the wheel (add them to pyproject's packages): {missing}"
    configs = {
        "lightning_sync/conf/" + p.relative_to(ROOT / "conf").as_posix() for p in (ROOT / "conf").rglob("*.yaml")
    }
    assert configs and not configs - names, f"configs missing from the wheel: {sorted(configs - names)}"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_wheel_holds_no_test_only_code(wheel: Path) -> None:
    """What only the test suite uses (the Slurm daemons' fixture, the CLI rank launcher, the Hydra warm-up with its
    test overrides) lives under ``tests/support`` and stays out of the wheel; what users and the bench use (the
    N-rank harness, the fault injector) ships, and no shipped module imports the test-only package."""
    whl = zipfile.ZipFile(wheel)
    modules = [n for n in whl.namelist() if n.endswith(".py")]
    assert modules and all(n.startswith("lightning_sync/") for n in modules), sorted(modules)[:5]
    test_only = {p.name for p in (ROOT / "tests" / "support").glob("*.py")} - {"__init__.py"}
    shipped = {n.rsplit("/", 1)[1] for n in modules}
    assert test_only and not test_only & shipped, f"test-only modules in the wheel: {sorted(test_only & shipped)}"
    assert {"lightning_sync/testing/harness.py", "lightning_sync/diagnostics/faults.py"} <= set(modules)
    importers = [n for n in modules if re.search(rb"^\s*(from|import) support\b", whl.read(n), re.M)]
    assert not importers, f"shipped modules import the test-only package: {importers}"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_wheel_ships_py_typed_and_the_license(wheel: Path) -> None:
    """py.typed (PEP 561) marks the package as typed for type checkers; the license text and its SPDX expression
    travel with every copy (PEP 639: dist-info/licenses/, License-Expression)."""
    whl = zipfile.ZipFile(wheel)
    names = set(whl.namelist())
    assert "lightning_sync/py.typed" in names, "py.typed missing: add it to pyproject's package-data"
    (dist_info,) = {n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info")}
    assert whl.read(f"{dist_info}/licenses/LICENSE") == (ROOT / "LICENSE").read_bytes()
    metadata = whl.read(f"{dist_info}/METADATA").decode().split("\n\n")[0].splitlines()
    assert "License-Expression: Apache-2.0" in metadata and "License-File: LICENSE" in metadata, metadata


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_installed_wheel_finds_its_config_from_any_directory(wheel: Path, tmp_path: Path) -> None:
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
        check=True,
        timeout=240,
        capture_output=True,
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(target)}
    proc = subprocess.run(
        [sys.executable, "-c", "import lightning_sync.cli as c; print(c.config_dir())"],
        cwd=elsewhere,
        env=env,
        text=True,
        capture_output=True,
        timeout=120,
        check=True,
    )
    assert Path(proc.stdout.strip()) == target / "lightning_sync" / "conf"
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_sync", "train", "--cfg", "job", "model=wide_mlp"],
        cwd=elsewhere,
        env=env,
        text=True,
        capture_output=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "WideMLP" in proc.stdout
