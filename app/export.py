"""Exporting a project's manuscript (Markdown, plain text, EPUB 3) and the whole project as a JSON file, and
importing such a file.

Pure functions from a project and its chapters (with text) to a string or bytes, plus ``export_project`` that reads
the database and writes a file for the browser to download. EPUB is a zip of XHTML files (stdlib ``zipfile``, no new
dependency). User text is escaped for each format: XML entities in EPUB; in Markdown, backslash escapes for
everything that would otherwise turn prose into markup (a line starting with "#", "-", "1." or ">", raw HTML tags),
so prose stays prose. The JSON file is ``storage.project_snapshot`` (lorebook, summaries and revisions included): a
project moves between studios with ``import_project_file``.
"""
from __future__ import annotations

import json
import re
import tempfile
import unicodedata
import uuid
import zipfile
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol
from xml.sax.saxutils import escape as xml_escape

FORMATS = {"markdown": ".md", "text": ".txt", "epub": ".epub", "json": ".json"}
MAX_IMPORT_BYTES = 50 * 2**20


class ProjectLike(Protocol):
    title: str
    kind: str
    premise: str


class ChapterLike(Protocol):
    title: str
    text: str


# -- Markdown -----------------------------------------------------------------------------------------------------

_MD_INLINE = re.compile(r"([\\`*_\[\]<>#|~])")
# Line starts that Markdown reads as structure: headings, quotes, bullets, ordered-list numbers ("12." / "12)").
_MD_BLOCK_START = re.compile(r"^(\s{0,3})(#|>|[-+*](?=\s|$)|\d{1,9}(?=[.)](?:\s|$)))")
_MD_ENTITY = re.compile(r"&(?=#?\w+;)")
# Whole lines that are rules or setext underlines ("---", "===", "* * *").
_MD_RULE = re.compile(r"^(\s{0,3})([-=*_])((?:\s*\2)*\s*)$")


def md_escape_inline(text: str) -> str:
    """Escape every Markdown-active character (for titles: one line, where nothing should be markup)."""
    return _MD_INLINE.sub(r"\\\1", " ".join(text.split()))


def md_escape_block(text: str) -> str:
    """Escape prose so Markdown renders it as prose: block markers at line starts, raw HTML, code spans.

    Ordinary punctuation (an asterisk in the middle of a sentence) is left alone to keep the file readable.
    """
    out = []
    for line in text.split("\n"):
        line = line.replace("\\", "\\\\").replace("<", "\\<").replace("`", "\\`")
        line = _MD_ENTITY.sub(r"\\&", line)  # "&copy;" would render as a symbol
        if _MD_RULE.match(line):
            line = _MD_RULE.sub(lambda m: m.group(1) + "\\" + m.group(2) + m.group(3), line)
        else:
            def fix(m: re.Match[str]) -> str:
                marker = m.group(2)
                if marker[0].isdigit():  # "1." -> "1\." (the number itself is not markup)
                    return m.group(1) + marker + "\\"
                return m.group(1) + "\\" + marker
            line = _MD_BLOCK_START.sub(fix, line)
        out.append(line)
    return "\n".join(out)


def to_markdown(project: ProjectLike, chapters: Sequence[ChapterLike]) -> str:
    """The manuscript as Markdown: a level-1 title, a level-2 heading per chapter, the text as paragraphs."""
    parts = [f"# {md_escape_inline(project.title)}\n"]
    for chapter in chapters:
        parts.append(f"## {md_escape_inline(chapter.title)}\n")
        body = chapter.text.strip()
        if body:
            parts.append(md_escape_block(body) + "\n")
    return "\n".join(parts)


# -- plain text ---------------------------------------------------------------------------------------------------

def to_text(project: ProjectLike, chapters: Sequence[ChapterLike]) -> str:
    """The manuscript as plain text: the title underlined, each chapter title underlined, texts as written."""
    def heading(title: str, rule: str) -> str:
        title = " ".join(title.split())
        return f"{title}\n{rule * max(3, len(title))}\n"

    parts = [heading(project.title, "=")]
    for chapter in chapters:
        parts.append(heading(chapter.title, "-"))
        if chapter.text.strip():
            parts.append(chapter.text.strip() + "\n")
    return "\n".join(parts)


# -- EPUB ---------------------------------------------------------------------------------------------------------

# XML 1.0 forbids most control characters; a model can emit them, and one would make the whole book unreadable.
_XML_BAD = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ufffe\uffff]")


def xhtml_escape(text: str) -> str:
    """Escape text for XHTML content and attribute values, dropping characters XML cannot hold."""
    return xml_escape(_XML_BAD.sub("", text), {'"': "&quot;"})


def paragraphs_xhtml(text: str) -> str:
    """Blank-line separated paragraphs as <p> elements; single newlines inside a paragraph become <br/>."""
    paras = [p.strip("\n") for p in re.split(r"\n\s*\n", text.strip()) if p.strip()]
    return "\n".join("<p>" + "<br/>\n".join(xhtml_escape(line) for line in p.split("\n")) + "</p>" for p in paras)


def _xhtml_page(title: str, body: str, lang: str) -> str:
    return ('<?xml version="1.0" encoding="utf-8"?>\n<!DOCTYPE html>\n'
            f'<html xmlns="http://www.w3.org/1999/xhtml" xmlns:epub="http://www.idpf.org/2007/ops" '
            f'lang="{lang}" xml:lang="{lang}">\n'
            f'<head><meta charset="utf-8"/><title>{xhtml_escape(title)}</title>'
            '<link rel="stylesheet" type="text/css" href="style.css"/></head>\n'
            f"<body>\n{body}\n</body>\n</html>\n")


_EPUB_CSS = """body { font-family: serif; line-height: 1.5; margin: 0 5%; }
h1, h2 { font-family: sans-serif; font-weight: 600; }
h1 { margin-top: 30%; text-align: center; }
p { margin: 0 0 0.8em; text-indent: 0; }
.premise { font-style: italic; text-align: center; }
"""


def to_epub(project: ProjectLike, chapters: Sequence[ChapterLike], *, lang: str = "en",
            identifier: str | None = None, modified: datetime | None = None) -> bytes:
    """The manuscript as an EPUB 3 book (title page, one XHTML file per chapter, navigation document, NCX)."""
    import io

    book_id = identifier or f"urn:uuid:{uuid.uuid4()}"
    stamp = (modified or datetime.now(UTC)).strftime("%Y-%m-%dT%H:%M:%SZ")
    title = " ".join(project.title.split()) or "Untitled"
    files: list[tuple[str, str, str]] = []  # (id, href, chapter title)
    pages: dict[str, str] = {}
    title_body = f"<h1>{xhtml_escape(title)}</h1>"
    pages["title.xhtml"] = _xhtml_page(title, title_body, lang)
    for n, chapter in enumerate(chapters, 1):
        href = f"chapter-{n:03d}.xhtml"
        ctitle = " ".join(chapter.title.split()) or f"Chapter {n}"
        body = (f'<section epub:type="chapter">\n<h2>{xhtml_escape(ctitle)}</h2>\n'
                f"{paragraphs_xhtml(chapter.text)}\n</section>")
        pages[href] = _xhtml_page(ctitle, body, lang)
        files.append((f"ch{n:03d}", href, ctitle))

    nav_items = "\n".join(f'<li><a href="{href}">{xhtml_escape(t)}</a></li>' for _, href, t in files)
    pages["nav.xhtml"] = _xhtml_page(title, f'<nav epub:type="toc" id="toc"><h2>Contents</h2>\n<ol>\n'
                                            f'<li><a href="title.xhtml">{xhtml_escape(title)}</a></li>\n{nav_items}\n'
                                            "</ol></nav>", lang)
    manifest = "\n".join(
        ['<item id="nav" href="nav.xhtml" media-type="application/xhtml+xml" properties="nav"/>',
         '<item id="ncx" href="toc.ncx" media-type="application/x-dtbncx+xml"/>',
         '<item id="css" href="style.css" media-type="text/css"/>',
         '<item id="title" href="title.xhtml" media-type="application/xhtml+xml"/>']
        + [f'<item id="{i}" href="{href}" media-type="application/xhtml+xml"/>' for i, href, _ in files])
    spine = "\n".join(['<itemref idref="title"/>'] + [f'<itemref idref="{i}"/>' for i, _, _ in files])
    opf = ('<?xml version="1.0" encoding="utf-8"?>\n'
           '<package xmlns="http://www.idpf.org/2007/opf" version="3.0" unique-identifier="book-id" '
           f'xml:lang="{lang}">\n<metadata xmlns:dc="http://purl.org/dc/elements/1.1/">\n'
           f'<dc:identifier id="book-id">{xhtml_escape(book_id)}</dc:identifier>\n'
           f"<dc:title>{xhtml_escape(title)}</dc:title>\n<dc:language>{lang}</dc:language>\n"
           "<dc:creator>TokenSwift Studio</dc:creator>\n"
           f'<meta property="dcterms:modified">{stamp}</meta>\n</metadata>\n'
           f'<manifest>\n{manifest}\n</manifest>\n<spine toc="ncx">\n{spine}\n</spine>\n</package>\n')
    nav_points = "\n".join(
        f'<navPoint id="np{n}" playOrder="{n}"><navLabel><text>{xhtml_escape(t)}</text></navLabel>'
        f'<content src="{href}"/></navPoint>' for n, (_, href, t) in enumerate(files, 1))
    ncx = ('<?xml version="1.0" encoding="utf-8"?>\n'
           '<ncx xmlns="http://www.daisy.org/z3986/2005/ncx/" version="2005-1">\n'
           f'<head><meta name="dtb:uid" content="{xhtml_escape(book_id)}"/></head>\n'
           f"<docTitle><text>{xhtml_escape(title)}</text></docTitle>\n<navMap>\n{nav_points}\n</navMap>\n</ncx>\n")
    container = ('<?xml version="1.0" encoding="utf-8"?>\n'
                 '<container version="1.0" xmlns="urn:oasis:names:tc:opendocument:xmlns:container">\n'
                 '<rootfiles><rootfile full-path="OEBPS/content.opf" media-type="application/oebps-package+xml"/>'
                 "</rootfiles>\n</container>\n")

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        # The OCF rule: "mimetype" first and stored uncompressed, so readers can sniff the type at a fixed offset.
        z.writestr(zipfile.ZipInfo("mimetype"), "application/epub+zip", compress_type=zipfile.ZIP_STORED)
        z.writestr("META-INF/container.xml", container, compress_type=zipfile.ZIP_DEFLATED)
        z.writestr("OEBPS/content.opf", opf, compress_type=zipfile.ZIP_DEFLATED)
        z.writestr("OEBPS/toc.ncx", ncx, compress_type=zipfile.ZIP_DEFLATED)
        z.writestr("OEBPS/style.css", _EPUB_CSS, compress_type=zipfile.ZIP_DEFLATED)
        for name, page in pages.items():
            z.writestr(f"OEBPS/{name}", page, compress_type=zipfile.ZIP_DEFLATED)
    return buf.getvalue()


# -- files --------------------------------------------------------------------------------------------------------

# Letters that Unicode does not decompose into an ASCII base letter.
_LETTERS = str.maketrans({"Æ": "AE", "æ": "ae", "Ø": "O", "ø": "o", "Œ": "OE", "œ": "oe", "ß": "ss", "Ł": "L",
                          "ł": "l", "Đ": "D", "đ": "d", "Þ": "Th", "þ": "th"})


def slugify(title: str, fallback: str = "project") -> str:
    """A safe, readable file name stem from a title ("Ærø: the Story!" -> "aero-the-story")."""
    ascii_title = unicodedata.normalize("NFKD", title.translate(_LETTERS)).encode("ascii", "ignore").decode()
    slug = re.sub(r"[^a-z0-9]+", "-", ascii_title.lower()).strip("-")[:60].strip("-")
    return slug or fallback


def render(fmt: str, project: ProjectLike, chapters: Sequence[ChapterLike]) -> bytes:
    """The manuscript in ``fmt`` ("markdown", "text" or "epub") as bytes (UTF-8 for the text formats)."""
    if fmt == "markdown":
        return to_markdown(project, chapters).encode("utf-8")
    if fmt == "text":
        return to_text(project, chapters).encode("utf-8")
    if fmt == "epub":
        return to_epub(project, chapters)
    raise ValueError(f"Unknown export format {fmt!r}; choose one of: {', '.join(FORMATS)}.")


def export_project(db: Any, project_id: int, fmt: str, folder: str | Path | None = None,
                   owner: str | None = None) -> Path:
    """Write project ``project_id`` (of ``owner``) as ``fmt`` into a fresh file (in ``folder`` or a new temp dir);
    returns its path."""
    from storage import get_project, list_chapters, project_snapshot

    if fmt not in FORMATS:
        raise ValueError(f"Unknown export format {fmt!r}; choose one of: {', '.join(FORMATS)}.")
    project = get_project(db, project_id, owner)
    if fmt == "json":
        data = json.dumps(project_snapshot(db, project_id, owner), ensure_ascii=False, indent=1).encode("utf-8")
    else:
        data = render(fmt, project, list_chapters(db, project_id, with_text=True, owner=owner))
    # A folder of its own per export: two exports of the same title never overwrite each other mid-download.
    out_dir = Path(tempfile.mkdtemp(prefix="tokenswift-export-", dir=folder))
    path = out_dir / (slugify(project.title) + FORMATS[fmt])
    path.write_bytes(data)
    return path


def import_project_file(db: Any, path: str | Path, owner: str) -> Any:
    """Create a new project of ``owner`` from a JSON project file; ValueError (storage's ValidationError) with a
    readable reason for a file that is not one, and nothing written."""
    from storage import import_project

    path = Path(path)
    if path.stat().st_size > MAX_IMPORT_BYTES:
        raise ValueError(f"The file is larger than {MAX_IMPORT_BYTES // 2**20} MB; a project file is not.")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"The file is not a JSON project file ({e}).") from None
    return import_project(db, data, owner)
