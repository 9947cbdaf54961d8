"""app/export.py: Markdown, plain text and EPUB content, escaping of user text, and files from the database."""
from __future__ import annotations

import io
import xml.etree.ElementTree as ET
import zipfile
from types import SimpleNamespace

import pytest

import storage
from app.export import (
    export_project,
    md_escape_block,
    md_escape_inline,
    paragraphs_xhtml,
    render,
    slugify,
    to_epub,
    to_markdown,
    to_text,
)

PROJECT = SimpleNamespace(title="The <Lighthouse> & *Keeper*", kind="novel", premise="ignored")
CHAPTERS = [
    SimpleNamespace(title="Storm [1]",
                    text="# Not a heading\nIt was *dark* & <b>cold</b>.\n\n1. Not a list\n- nor this"),
    SimpleNamespace(title="Calm", text="Second paragraph.\n\nThird one,\nwith a line break."),
    SimpleNamespace(title="Empty", text=""),
]


def test_markdown_structure_and_escaping():
    md = to_markdown(PROJECT, CHAPTERS)
    lines = md.splitlines()
    assert lines[0] == r"# The \<Lighthouse\> & \*Keeper\*"
    assert r"## Storm \[1\]" in lines and "## Calm" in lines and "## Empty" in lines
    assert r"\# Not a heading" in lines
    assert r"It was *dark* & \<b>cold\</b>." in lines  # mid-sentence asterisks kept readable; no raw HTML
    assert r"1\. Not a list" in lines and r"\- nor this" in lines
    assert "Third one,\nwith a line break." in md
    assert "ignored" not in md  # the premise is a prompt, not part of the manuscript


@pytest.mark.parametrize("line, escaped", [
    ("> quote", r"\> quote"), ("* bullet", r"\* bullet"), ("+ plus", r"\+ plus"), ("12) item", r"12\) item"),
    ("---", r"\---"), ("===", r"\==="), ("* * *", r"\* * *"), ("`code`", r"\`code\`"), ("a\\b", r"a\\b"),
    ("&copy; here", r"\&copy; here"), ("Tom & Jerry", "Tom & Jerry"), ("2024 was", "2024 was"),
    ("-dash start", "-dash start"),
])
def test_markdown_block_escapes(line, escaped):
    assert md_escape_block(line) == escaped


def test_markdown_inline_escapes_and_flattens():
    assert md_escape_inline("a_b\n#c|d") == r"a\_b \#c\|d"


def test_plain_text_is_verbatim():
    text = to_text(PROJECT, CHAPTERS)
    assert text.startswith("The <Lighthouse> & *Keeper*\n" + "=" * len(PROJECT.title) + "\n")
    assert "Storm [1]\n---------\n" in text
    assert "It was *dark* & <b>cold</b>." in text
    assert text.index("Storm") < text.index("Calm") < text.index("Empty")


def test_epub_is_a_valid_book_with_escaped_text():
    data = to_epub(PROJECT, CHAPTERS, identifier="urn:uuid:test")
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        infos = z.infolist()
        assert infos[0].filename == "mimetype" and infos[0].compress_type == zipfile.ZIP_STORED
        assert z.read("mimetype") == b"application/epub+zip"
        names = z.namelist()
        for required in ("META-INF/container.xml", "OEBPS/content.opf", "OEBPS/nav.xhtml", "OEBPS/toc.ncx",
                         "OEBPS/chapter-001.xhtml", "OEBPS/chapter-003.xhtml"):
            assert required in names
        for name in names:
            if name.endswith((".xhtml", ".opf", ".ncx", ".xml")):
                ET.fromstring(z.read(name))  # every XML file is well-formed
        chapter = z.read("OEBPS/chapter-001.xhtml").decode()
        assert "&lt;b&gt;cold&lt;/b&gt;" in chapter and "<b>" not in chapter
        assert "<p># Not a heading<br/>" in chapter
        calm = z.read("OEBPS/chapter-002.xhtml").decode()
        assert "<p>Second paragraph.</p>" in calm and "<p>Third one,<br/>\nwith a line break.</p>" in calm
        opf = z.read("OEBPS/content.opf").decode()
        assert "<dc:title>The &lt;Lighthouse&gt; &amp; *Keeper*</dc:title>" in opf
        assert opf.index('idref="ch001"') < opf.index('idref="ch002"') < opf.index('idref="ch003"')
        nav = z.read("OEBPS/nav.xhtml").decode()
        assert "Storm [1]" in nav and "Calm" in nav


def test_epub_drops_characters_xml_cannot_hold():
    assert paragraphs_xhtml("bell\x07 and\x00 nul") == "<p>bell and nul</p>"
    data = to_epub(SimpleNamespace(title="T\x01", kind="other", premise=""),
                   [SimpleNamespace(title="C", text="x\x0by")])
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        ET.fromstring(z.read("OEBPS/chapter-001.xhtml"))


def test_slugify_and_unknown_format():
    assert slugify("Ærø: the Story!") == "aero-the-story"
    assert slugify("Straße über Łódź") == "strasse-uber-lodz"
    assert slugify("???") == "project"
    assert slugify("x" * 200) == "x" * 60
    with pytest.raises(ValueError, match="Unknown export format"):
        render("pdf", PROJECT, CHAPTERS)


def test_export_project_from_the_database(tmp_path):
    with storage.open_database(tmp_path / "studio.db") as db:
        project = storage.create_project(db, "My Book")
        one = storage.add_chapter(db, project.id, "One")
        two = storage.add_chapter(db, project.id, "Two")
        storage.set_chapter_text(db, two.id, "Second.")
        storage.set_chapter_text(db, one.id, "First.")
        storage.move_chapter(db, two.id, 0)  # order follows the chapter list, not creation
        paths = {fmt: export_project(db, project.id, fmt, folder=tmp_path) for fmt in ("markdown", "text", "epub")}
        assert paths["markdown"].name == "my-book.md" and paths["epub"].suffix == ".epub"
        md = paths["markdown"].read_text(encoding="utf-8")
        assert md.index("## Two") < md.index("## One") and "First." in md
        assert paths["text"].read_text(encoding="utf-8").startswith("My Book\n")
        assert zipfile.is_zipfile(paths["epub"])
        again = export_project(db, project.id, "markdown", folder=tmp_path)
        assert again != paths["markdown"]  # a fresh folder per export: concurrent downloads never collide
        with pytest.raises(storage.NotFoundError):
            export_project(db, 999, "markdown", folder=tmp_path)
