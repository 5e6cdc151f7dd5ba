"""docs/ARCHITECTURE.md names the code as it is: every path it gives exists, every file name it gives is a
module or a file the product writes, and every name it gives in backticks (a module, a class, a function, a
method, a key) is one the code uses. A rename or a removal that leaves the doc behind fails here."""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "ARCHITECTURE.md"
CODE_NAME = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*(\(\))?$")
FILE_NAME = re.compile(r"^[\w.-]+\.(py|json|pt|ckpt|yaml)$")


def backticked() -> list[str]:
    return re.findall(r"`([^`\n]+)`", DOC.read_text())


def sources() -> list[Path]:
    return [*(REPO / "moe").rglob("*.py"), *REPO.glob("*.py"), *(REPO / "conf").rglob("*.yaml"),
            REPO / "Makefile"]


def words_in_the_code() -> tuple[set[str], str]:
    """(every word of the code and the file names of moe/, the code's text)."""
    text = "\n".join(path.read_text() for path in sources())
    return {path.name for path in sources()} | set(re.findall(r"[A-Za-z_]\w*", text)), text


def test_every_path_the_architecture_doc_gives_exists():
    paths = [t for t in backticked() if re.match(r"^(moe|tests|bench|conf|docs|slurm)/", t)]
    assert len(paths) > 20
    missing = [p for p in paths
               if not re.search(r"[<*]", p) and not (REPO / p.split(":")[0].rstrip("/")).exists()]
    assert not missing, f"docs/ARCHITECTURE.md names paths that do not exist: {missing}"


def test_every_name_the_architecture_doc_gives_is_in_the_code():
    words, text = words_in_the_code()
    files = [t for t in backticked() if FILE_NAME.match(t) and not re.search(r"-N\.", t)]
    names = [t for t in backticked() if t not in files and CODE_NAME.match(t)
             and ("_" in t or "." in t or t[:1].isupper() or t.endswith("()"))]
    assert len(names) > 50 and len(files) > 10
    missing = sorted({t for t in files if t not in words and t not in text}
                     | {t for t in names
                        if not all(part in words for part in t.removesuffix("()").split("."))})
    assert not missing, f"docs/ARCHITECTURE.md names what the code does not: {missing}"
