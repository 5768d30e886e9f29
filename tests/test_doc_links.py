"""The repository's Markdown links lead somewhere: a relative link names a file or folder
that exists, and a link to a section (``FILE.md#anchor``) names one of that file's
headings, slugged as GitHub slugs them.  The README cites RESULTS.md by section, and
a renamed run heading would otherwise leave the citation dangling."""

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: An inline link's target, with an optional title after it: [text](target "title").
LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
#: A reference definition's target: [name]: target
REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.M)
FENCE = re.compile(r"^ {0,3}(```|~~~).*?^ {0,3}\1", re.M | re.S)


def slug(heading):
    """GitHub's anchor for a Markdown heading: lower case, punctuation but '-' and '_'
    dropped, each space a '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def markdown_files():
    out = []
    for top in ("README.md", "benchmarks", "docs", "python", "csrc", "kernels"):
        path = os.path.join(ROOT, top)
        if os.path.isfile(path):
            out.append(path)
        for root, _, names in os.walk(path):
            out.extend(os.path.join(root, n) for n in sorted(names) if n.endswith(".md"))
    return out


def prose(path):
    """The file's text without its fenced code blocks (a '# comment' there is no heading,
    a ](x) there no link)."""
    with open(path, encoding="utf-8") as f:
        return FENCE.sub("", f.read())


def headings(path):
    """The anchors of the file's headings; a repeated one also as GitHub numbers it
    (-1, -2, ...)."""
    seen: dict = {}
    out = set()
    for line in prose(path).splitlines():
        m = re.match(r" {0,3}#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(path):
    """The links in Markdown file ``path`` that lead nowhere, as written."""
    text = prose(path)
    bad = []
    for target in LINK.findall(text) + REFERENCE.findall(text):
        if re.match(r"[a-z]+:", target):            # http:, https:, mailto:
            continue
        name, _, anchor = target.partition("#")
        if name.startswith("/"):                    # from the repository's root
            dest = os.path.normpath(os.path.join(ROOT, name.lstrip("/")))
        elif name:
            dest = os.path.normpath(os.path.join(os.path.dirname(path), name))
        else:
            dest = path
        if not os.path.exists(dest):
            bad.append(target)
        elif anchor and dest.endswith(".md") and anchor not in headings(dest):
            bad.append(target)
    return bad


def test_every_markdown_link_leads_somewhere():
    if not os.path.exists(os.path.join(ROOT, "README.md")):
        pytest.skip("no README.md beside tests/ (an installed copy of the tests)")
    bad = {os.path.relpath(p, ROOT): b for p in markdown_files() if (b := broken_links(p))}
    assert not bad, bad


def test_the_link_check_finds_a_missing_file_and_a_missing_section(tmp_path):
    (tmp_path / "R.md").write_text("# Run 27: the loads' share (2026-12-06, H100)\n"
                                   "## Dup\n## Dup\n#NoSpace\n"
                                   "```bash\n# a comment, not a heading\n```\n")
    page = tmp_path / "README.md"
    page.write_text("[a](R.md#run-27-the-loads-share-2026-12-06-h100) [b](gone.md) "
                    "[c](R.md#run-28) [d](https://example.com/x) [e](#top)\n# Top\n"
                    "[f](R.md#dup-1) [g](R.md#nospace) [h](R.md#a-comment-not-a-heading)\n"
                    '[i](gone2.md "a title") [j][ref]\n\n[ref]: gone3.md\n'
                    "```\n[k](in-a-code-block.md)\n```\n")
    assert broken_links(str(page)) == ["gone.md", "R.md#run-28", "R.md#nospace",
                                       "R.md#a-comment-not-a-heading", "gone2.md", "gone3.md"]
