"""ZeRO++'s hpZ is never called HSDP's idea (issue 48).

HSDP (shard inside a group, replicate across) is DeepSpeed's MiCS. hpZ keeps the states
sharded over all N ranks and adds a secondary copy of the parameters sharded inside a node:
the int `reshard_after_forward`. Every mention of hpZ in the package, its guides and the
notebooks must sit beside `reshard_after_forward`, and none may pair it with MiCS.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WINDOW = 400  # characters either side of a mention


def texts() -> dict[str, str]:
    found = {p: p.read_text(encoding="utf-8") for p in (ROOT / "zero_lab").rglob("*.py")}
    found |= {p: p.read_text(encoding="utf-8") for d in (ROOT, ROOT / "zero_lab")
              for p in d.glob("*.md")}
    for nb in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"):
        cells = json.loads(nb.read_text(encoding="utf-8"))["cells"]
        found[nb] = "\n".join("".join(c["source"]) for c in cells)
    return {str(p.relative_to(ROOT)): " ".join(t.split()) for p, t in found.items()}


def test_hpz_is_never_hsdps_idea():
    mentions = 0
    for name, text in texts().items():
        assert not re.search(r"hpZ\s*/\s*MiCS|MiCS\s*/\s*hpZ", text), f"{name}: hpZ / MiCS"
        for hit in re.finditer(r"hpZ", text):
            mentions += 1
            around = text[max(0, hit.start() - WINDOW):hit.end() + WINDOW]
            assert "reshard_after_forward" in around, f"{name}: hpZ without its int form"
    assert mentions >= 3  # hybrid.py, the package guide, notebook 08
