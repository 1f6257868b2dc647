"""README "Layout" names every ``coldsnap_core`` module at the layer the layering test's table gives it.

README's rows are ``  L<layer>  <module> <module> ...`` (a ``/`` for a package: ``cache/payload_cache``; ``cache/``
for the package itself), a description after two or more spaces; continuation rows start with spaces only.
"""

from __future__ import annotations

import re
from pathlib import Path

from tests.core.test_layering import LAYERS

README = Path(__file__).resolve().parents[2] / "README.md"
ROW = re.compile(r"^  L(\d+)  (\S+(?: \S+)*)")


def _readme_layers() -> dict[str, int]:
    text = README.read_text(encoding="utf-8")
    start = text.index("## Layout\n")
    end = text.find("\n## ", start + 1)
    end = len(text) if end < 0 else end
    found: dict[str, int] = {}
    for line in text[start:end].splitlines():
        match = ROW.match(line)
        if match is None:
            continue
        for token in match.group(2).split(" "):
            module = token.rstrip("/").replace("/", ".")
            assert module not in found, f"README Layout names {token} twice"
            found[module] = int(match.group(1))
    return found


def test_readme_layout_is_the_layering_table() -> None:
    """Fails naming each module README "Layout" leaves out, names at another layer than LAYERS, or names
    although LAYERS does not (a module moved or added without the README following)."""
    table = {module: layer for module, layer in LAYERS.items() if module}
    readme = _readme_layers()
    missing = sorted(set(table) - set(readme))
    unknown = sorted(set(readme) - set(table))
    moved = sorted(f"{m}: README L{readme[m]}, LAYERS {table[m]}" for m in set(table) & set(readme) if readme[m] != table[m])
    assert (missing, unknown, moved) == ([], [], [])
