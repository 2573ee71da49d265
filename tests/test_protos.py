"""The committed generated code (spindle/v1) is what scripts/gen_protos.sh makes from the protos."""

from __future__ import annotations

import filecmp
import subprocess
import sys

from tests.service_helpers import ROOT


def test_generated_code_matches_the_protos(tmp_path):
    subprocess.run(
        ["bash", str(ROOT / "scripts" / "gen_protos.sh"), str(tmp_path)],
        check=True,
        env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"},
    )
    fresh = sorted(p.relative_to(tmp_path) for p in (tmp_path / "spindle" / "v1").iterdir())
    committed = ROOT / "spindle" / "v1"
    have = sorted(p.relative_to(ROOT) for p in committed.iterdir() if p.suffix in (".py", ".pyi"))
    assert [str(p) for p in fresh] == [str(p) for p in have if p.name != "__init__.py"]
    stale = [str(p) for p in fresh if not filecmp.cmp(tmp_path / p, ROOT / p, shallow=False)]
    assert not stale, f"{stale} differ from the protos: run scripts/gen_protos.sh and commit the result"
