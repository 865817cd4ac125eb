"""The docs stay true to the code: generated reference tables, a short README, working links.

The configuration reference in ``docs/configuration.md`` is generated from the config
dataclasses. After changing a field, its type, default or docstring, regenerate it::

    python tests/api/test_docs.py --write

which rewrites only the text between the ``<!-- generated:NAME -->`` and
``<!-- end:NAME -->`` markers. No processes, no store: this file runs in well under a second.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import sys
import typing
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
CONFIG_DOC = DOCS / "configuration.md"
README_MAX_LINES = 300
WRITE_COMMAND = "python tests/api/test_docs.py --write"


# -- generating the reference tables --------------------------------------------------
def _attribute_help(cls: type) -> dict[str, str]:
    """``name -> help`` from the ``Attributes:`` section of ``cls``'s Google-style docstring."""
    lines = inspect.cleandoc(cls.__doc__ or "").splitlines()
    helps: dict[str, list[str]] = {}
    inside, indent, current = False, None, None
    for line in lines:
        stripped = line.strip()
        if stripped == "Attributes:":
            inside, indent, current = True, None, None
            continue
        if not inside:
            continue
        if not stripped:
            continue
        depth = len(line) - len(line.lstrip())
        if indent is None:
            indent = depth
        if depth < indent:
            break  # the section ended (a dedented paragraph)
        match = re.match(r"(\w+)(?: \([^)]*\))?: (.*)", stripped)
        if depth == indent and match:
            current = match.group(1)
            helps[current] = [match.group(2)]
        elif depth > indent and current is not None:
            helps[current].append(stripped)
        else:
            break
    return {name: _inline(" ".join(parts)) for name, parts in helps.items()}


def _inline(text: str) -> str:
    """reStructuredText inline markup as Markdown, safe inside a table cell."""
    text = re.sub(r":\w+:`~?(?:[\w.]+\.)?(\w+)`", r"`\1`", text)  # :class:`~pkg.Name` -> `Name`
    text = text.replace("``", "`")
    return text.replace("|", "\\|")


def _default(field: dataclasses.Field[object]) -> str:
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        return "required"
    if value == "???":  # omegaconf.MISSING: Hydra's "required"
        return "required"
    return f'`"{value}"`' if isinstance(value, str) else f"`{value!r}`"


def _type(cls: type, field: dataclasses.Field[object]) -> str:
    """The field's annotation as written, except a ``Literal`` alias, shown as its values."""
    hint = typing.get_type_hints(cls).get(field.name)
    if typing.get_origin(hint) is typing.Literal:
        return " | ".join(f'"{v}"' if isinstance(v, str) else repr(v) for v in typing.get_args(hint))
    return str(field.type)


def config_table(
    cls: type,
    *,
    skip: Callable[[str], bool] = lambda name: False,
    key: Callable[[str], str] = lambda name: name,
    header: str = "field",
) -> str:
    """A Markdown table of ``cls``'s dataclass fields: field (or ``key(field)``), type, default, help."""
    helps: dict[str, str] = {}
    for klass in reversed(cls.__mro__):  # a subclass's own words win
        helps.update(_attribute_help(klass))
    rows = [f"| {header} | type | default | help |", "|---|---|---|---|"]
    for field in dataclasses.fields(cls):  # type: ignore[arg-type]
        if skip(field.name):
            continue
        kind = _type(cls, field).replace("|", "\\|")
        rows.append(f"| `{key(field.name)}` | `{kind}` | {_default(field)} | {helps.get(field.name, '')} |")
    return "\n".join(rows)


def generated_sections() -> dict[str, str]:
    """Every generated block of ``docs/configuration.md``, by marker name."""
    from lightning_wsync.config import CallbackConfig, ReceiverConfig, SenderConfig
    from lightning_wsync.rendezvous._config import WsyncRendezvousConfig

    sender_fields = {f.name for f in dataclasses.fields(SenderConfig)}
    return {
        "sender-config": config_table(SenderConfig),
        "receiver-config": config_table(ReceiverConfig),
        # The callback takes every sender field too (listed above); `_target_`/`_convert_` are Hydra's.
        "callback-config": config_table(
            CallbackConfig, skip=lambda name: name in sender_fields or name.startswith("_")
        ),
        # --rdzv-conf keys keep c10d's names: the field without its `_s` unit.
        "rdzv-conf": config_table(WsyncRendezvousConfig, key=lambda name: name.removesuffix("_s"), header="key"),
    }


def _marked(name: str) -> re.Pattern[str]:
    return re.compile(rf"(<!-- generated:{re.escape(name)} [^\n]*-->\n)(.*?)(<!-- end:{re.escape(name)} -->)", re.S)


def render(text: str, sections: dict[str, str]) -> str:
    """``text`` with every marked block replaced by its generated table."""
    for name, table in sections.items():
        pattern = _marked(name)
        if not pattern.search(text):
            raise ValueError(f"no '<!-- generated:{name} ... -->' ... '<!-- end:{name} -->' markers in {CONFIG_DOC}")
        text = pattern.sub(lambda m, table=table: m.group(1) + table + "\n" + m.group(3), text)
    return text


# -- links ----------------------------------------------------------------------------
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"(?<!!)\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)


def _prose(text: str) -> str:
    """``text`` without fenced code blocks and inline code (links there are not links)."""
    return _CODE.sub("", _FENCE.sub("", text))


def anchors(path: Path) -> set[str]:
    """The anchors GitHub makes for ``path``'s headings."""
    seen: dict[str, int] = {}
    out = set()
    for heading in _HEADING.findall(_FENCE.sub("", path.read_text())):
        heading = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def doc_files() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def relative_links(path: Path) -> Iterator[tuple[str, Path, str]]:
    """``(link, target file, anchor)`` for every relative link in ``path``."""
    for link in _LINK.findall(_prose(path.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", link):  # http:, https:, mailto:
            continue
        target, _, anchor = link.partition("#")
        yield link, (path.parent / target).resolve() if target else path, anchor


def broken_links() -> list[str]:
    broken = []
    for path in doc_files():
        for link, target, anchor in relative_links(path):
            where = f"{path.relative_to(ROOT)}: ({link})"
            if not target.exists():
                broken.append(
                    f"{where}: {target.relative_to(ROOT) if target.is_relative_to(ROOT) else target} does not exist"
                )
            elif anchor and (target.suffix != ".md" or anchor not in anchors(target)):
                broken.append(f"{where}: no heading with anchor #{anchor} in {target.relative_to(ROOT)}")
    return broken


# -- tests ----------------------------------------------------------------------------
def test_configuration_reference_matches_the_dataclasses():
    text = CONFIG_DOC.read_text()
    expected = render(text, generated_sections())
    if text != expected:
        changed = [name for name, table in generated_sections().items() if table not in text]
        raise AssertionError(
            f"{CONFIG_DOC.relative_to(ROOT)}: the generated tables {changed} differ from the config dataclasses "
            f"(lightning_wsync/config.py, lightning_wsync/rendezvous/_config.py); regenerate them with "
            f"`{WRITE_COMMAND}` and commit the result"
        )


def test_attribute_help_is_read_from_docstrings():
    from lightning_wsync.config import ReceiverConfig, SenderConfig

    sender = _attribute_help(SenderConfig)
    assert sender["bucket_mb"].startswith("size of the network send unit")
    assert sender["cross_host"].startswith('with `transport="auto"`') and '`"star"`' in sender["cross_host"]
    assert "delta" in sender and "heartbeat_timeout_s" in sender
    assert set(_attribute_help(ReceiverConfig)) >= {"name", "verify", "apply", "heartbeat_s"}


def test_every_config_field_is_documented():
    """A field added without an ``Attributes:`` entry would reach the reference with no help."""
    for name, table in generated_sections().items():
        empty = [row.split("|")[1].strip() for row in table.splitlines()[2:] if row.rstrip().endswith("|  |")]
        assert not empty, f"{name}: fields without help in their dataclass docstring: {empty}"


def test_readme_is_a_front_door():
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines, more than {README_MAX_LINES}: move the detail into a page of docs/ "
        f"and link it from the README's map of the docs"
    )


def test_relative_links_point_at_files_and_headings():
    assert list(relative_links(README)), "README.md links to no page of docs/"
    broken = broken_links()
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_link_checker_sees_broken_links(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Other page\n\n## A `code` heading, with punctuation!\n")
    page.write_text(
        "[ok](other.md) [ok](other.md#a-code-heading-with-punctuation) [web](https://example.com)\n"
        "[missing](nope.md) [bad anchor](other.md#nothing) `[in code](nope.md)`\n"
        "```\n[in a fence](nope.md)\n```\n"
    )
    found = [(link, target.name, anchor) for link, target, anchor in relative_links(page)]
    assert found == [
        ("other.md", "other.md", ""),
        ("other.md#a-code-heading-with-punctuation", "other.md", "a-code-heading-with-punctuation"),
        ("nope.md", "nope.md", ""),
        ("other.md#nothing", "other.md", "nothing"),
    ]
    assert "a-code-heading-with-punctuation" in anchors(tmp_path / "other.md")


def test_render_replaces_only_the_marked_block():
    text = "before\n<!-- generated:x (run it) -->\nold\n<!-- end:x -->\nafter\n"
    assert render(text, {"x": "new"}) == "before\n<!-- generated:x (run it) -->\nnew\n<!-- end:x -->\nafter\n"


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit(f"usage: {WRITE_COMMAND}   (rewrites the generated tables of {CONFIG_DOC.relative_to(ROOT)})")
    old = CONFIG_DOC.read_text()
    new = render(old, generated_sections())
    CONFIG_DOC.write_text(new)
    print(f"{CONFIG_DOC.relative_to(ROOT)}: {'rewritten' if new != old else 'already up to date'}")
