"""The documents keep the shape the project promises, where a reader of both can check it.

- docs/PERFORMANCE.md opens with one table of the current goals: every row a
  goal, its latest figure, a verdict, the run's date and its source.
- Every link to a section (`[...](#anchor)`, `[...](OTHER.md#anchor)`) in
  README.md and docs/*.md reaches a heading that exists, as GitHub names them.
"""
import os
import re
import unicodedata

SRC = os.environ.get("ZS_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", ".."))
DOCS = os.path.join(SRC, "docs")


def read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def without_code_blocks(text):
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def slug(heading):
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    s = heading.strip().lower()
    s = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", s)  # a link keeps its text
    out = []
    for ch in s:
        cat = unicodedata.category(ch)
        if ch in " -_" or cat[0] in ("L", "N") or cat == "Mn":
            out.append("-" if ch == " " else ch)
    return "".join(out)


def anchors(path):
    seen, result = {}, set()
    for line in without_code_blocks(read(path)).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        result.add(base if n == 0 else f"{base}-{n}")
    return result


def test_performance_opens_with_the_current_goal_table():
    text = read(os.path.join(DOCS, "PERFORMANCE.md"))
    sections = re.findall(r"^## (.*)$", text, re.M)
    assert sections[0] == "Current goals", sections[:3]
    first = text.split("\n## ", 2)[1]
    rows = [l for l in first.splitlines() if l.startswith("|")]
    head = [c.strip() for c in rows[0].strip("|").split("|")]
    assert head == ["goal (target)", "latest figure", "met?", "run date (UTC)", "source", "note"], head
    assert set(rows[1].replace("|", "").replace(" ", "")) <= set("-:"), rows[1]
    body = rows[2:]
    assert len(body) >= 20, len(body)
    bad = []
    for row in body:
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", row.strip().strip("|"))]
        if len(cells) != 6:
            bad.append(f"{len(cells)} cells: {row[:80]}")
            continue
        goal, figure, met, date, source, _ = cells
        if not goal or not figure or not met or not source:
            bad.append(f"an empty goal, figure, verdict or source: {row[:80]}")
        # A goal no run could measure yet (no GPU was lent) says so and has no date.
        unmeasured = figure.startswith("not measured") and date in ("–", "-")
        if not unmeasured and not re.match(r"20\d\d-\d\d-\d\d", date):
            bad.append(f"no run date: {row[:80]}")
    assert not bad, "\n".join(bad)


def test_every_link_to_a_section_reaches_a_heading():
    files = [os.path.join(SRC, "README.md")] + sorted(
        os.path.join(DOCS, f) for f in os.listdir(DOCS) if f.endswith(".md"))
    known = {os.path.realpath(f): anchors(f) for f in files}
    broken = []
    for f in files:
        text = without_code_blocks(read(f))
        for n, line in enumerate(text.splitlines(), 1):
            for target, anchor in re.findall(r"\]\(([^)#\s]*)#([^)\s]+)\)", line):
                if target.startswith(("http:", "https:")):
                    continue
                dest = os.path.realpath(os.path.join(os.path.dirname(f), target)) if target else \
                    os.path.realpath(f)
                if dest not in known:
                    if not os.path.isfile(dest):
                        broken.append(f"{os.path.relpath(f, SRC)}:{n}: {target} does not exist")
                    continue
                if anchor not in known[dest]:
                    broken.append(f"{os.path.relpath(f, SRC)}:{n}: #{anchor} is no heading of "
                                  f"{os.path.relpath(dest, SRC)}")
    assert not broken, "\n".join(broken)
