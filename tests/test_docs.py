"""The documentation site: it builds with --strict (no dead link, no page missing from
the nav, every API entry resolves), every public name has an API entry, and the
architecture page names every module of the tree."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_every_public_name_has_an_api_entry():
    """`docs/api.md` documents each name of `pathways_ray.__all__` under the module that
    defines it (a moved name fails here, not on a user's page)."""
    import pathways_ray as pr

    api = (ROOT / "docs" / "api.md").read_text()
    missing = []
    for name in pr.__all__:
        obj = getattr(pr, name)
        if f"::: {obj.__module__}.{name}\n" not in api:
            missing.append(f"{obj.__module__}.{name}")
    assert missing == []


def test_the_architecture_page_names_every_module_and_the_readme_every_folder():
    page = (ROOT / "docs" / "architecture.md").read_text()
    readme = (ROOT / "README.md").read_text()
    package = ROOT / "pathways_ray"
    generated = package / "proxy" / "protos"
    missing = [str(p.relative_to(package)) for p in sorted(package.rglob("*.py"))
               if p.name != "__init__.py" and generated not in p.parents
               and f"`{p.relative_to(package)}`" not in page]
    assert missing == []
    folders = [d.name for d in package.iterdir() if (d / "__init__.py").exists()]
    assert [f for f in folders if f"{f}/" not in readme] == []
    assert len(readme.splitlines()) <= 200


@pytest.mark.skipif(shutil.which("mkdocs", path=str(Path(sys.executable).parent)) is None,
                    reason="mkdocs is not installed (pip install 'pathways-ray[docs]')")
def test_the_site_builds_strictly(tmp_path):
    """What `./run.sh docs` does, with --strict: a warning (a dead link, a page outside
    the nav, an API entry that does not resolve) fails the build."""
    mkdocs = Path(sys.executable).parent / "mkdocs"
    out = subprocess.run([str(mkdocs), "build", "--strict", "--site-dir", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert (tmp_path / "index.html").exists() and (tmp_path / "api" / "index.html").exists()
    api = (tmp_path / "api" / "index.html").read_text()
    assert "def connect" in api or "connect(" in api
