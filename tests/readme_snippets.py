"""The README's code blocks, by the heading they sit under.

    python3 tests/readme_snippets.py list
    python3 tests/readme_snippets.py show "### Python" [python]   # prints the block

Used by tests/python/test_readme.py (which runs every snippet) and by
tests/fresh_clone.sh (which runs the Python quick start from an installed
wheel), so the README is the one copy of its examples.
"""

from __future__ import annotations

import pathlib
import sys
from typing import List, NamedTuple

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


class Snippet(NamedTuple):
    heading: str  # the nearest heading above, with its #s: "### Python"
    lang: str  # the fence's info string: "c", "cpp", "python", "go", "sh"
    code: str
    line: int  # 1-based line of the opening fence


def snippets(path: pathlib.Path = README) -> List[Snippet]:
    out: List[Snippet] = []
    heading, lang, start, body = "", None, 0, []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if lang is None:
            if line.startswith("```"):
                lang, start, body = line[3:].strip(), i, []
            elif line.startswith("#"):
                heading = line.strip()
        elif line.startswith("```"):
            out.append(Snippet(heading, lang, "\n".join(body) + "\n", start))
            lang = None
        else:
            body.append(line)
    if lang is not None:
        raise ValueError(f"{path}:{start}: code block never closed")
    return out


def find(heading: str, lang: str) -> Snippet:
    found = [s for s in snippets() if s.heading == heading and s.lang == lang]
    if len(found) != 1:
        raise LookupError(f"README.md has {len(found)} {lang} blocks under {heading!r}, expected 1")
    return found[0]


if __name__ == "__main__":
    if sys.argv[1:2] == ["list"]:
        for s in snippets():
            print(f"{s.line:4d}  {s.lang:8s} {s.heading}")
    elif sys.argv[1:2] == ["show"] and len(sys.argv) in (3, 4):
        sys.stdout.write(find(sys.argv[2], sys.argv[3] if len(sys.argv) == 4 else "python").code)
    else:
        sys.exit(__doc__)
