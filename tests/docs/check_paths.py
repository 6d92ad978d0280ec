#!/usr/bin/env python3
"""Checks that every path and document section the tree cites exists.

    python3 tests/docs/check_paths.py [--root DIR] [FILE ...]

Scans the tracked text files (`git ls-files`; where git or the repository is
missing, a walk that skips build*/ and hidden folders), or the FILEs given:
documents (*.md) whole, code only in its comments and docstrings (C++ and
CUDA `//` and `/* */`; Python `#` and triple-quoted strings; shell, CMake,
TOML and the like `#`). It looks for three kinds of citation:

  paths      repository-relative paths under docs/, src/, tests/, bench/,
             scripts/, include/fp4moe/, python/, tools/, examples/, fuzz/ and
             cmake/ must name a file or folder of the tree, from the root or
             from the citing file's folder. `*` globs and `{a,b}` lists are
             expanded; an upper-case placeholder (`tests/DIR/NAME`) or a
             variable ends what is checked. A path written after a git
             revision (`results:bench/...`) names another tree and is not
             checked, nor is one inside a longer path (`build-sm90/tools/x`),
             nor the build-tree outputs of BUILD_TREE_PATHS.
  sections   `docs/design.md §4.2`, `` `docs/performance.md` §5.3, §5.11 ``:
             each § must be the number of a heading of that document
             (`## §4 ...`, `### §4.2 ...`). A bare `§N` cites the document it
             is written in where that document numbers its headings so, and
             docs/design.md elsewhere (code comments cite it that way).
  headings   `docs/performance.md, "Row classes"` or
             `docs/performance.md §5.11, "Row classes"`: a heading of the
             document (that section's, where a § is given) must start with
             the quoted text, its § number aside.

Prints `file:line: what` for each one that is missing and exits 1; exits 0
with a one-line summary otherwise. Python 3 standard library only.
"""
import argparse
import fnmatch
import os
import re
import subprocess
import sys

ROOTS = ("docs", "src", "tests", "bench", "scripts", "include/fp4moe", "python", "tools", "examples", "fuzz",
         "cmake")
# Data, not text that cites anything: benchmark output, fuzz inputs, test data.
SKIP_PREFIXES = ("bench/results/", "fuzz/regressions/", "tests/data/")
SKIP_SUFFIXES = (".png", ".jpg", ".safetensors", ".jsonl", ".json", ".bin", ".gz")
# Paths of a build tree, not of the source tree, that comments and documents
# name as such (`BUILD/tools/fp4moe`, "the previous commit's tools/fp4moe").
BUILD_TREE_PATHS = ("tools/fp4moe",)
C_LIKE = (".c", ".cc", ".cpp", ".cxx", ".cu", ".cuh", ".h", ".hpp", ".inl")

# A path starts at a top-level folder not preceded by anything that would make
# it part of a longer path, a revision (`REV:path`), a variable or an option.
PATH_RE = re.compile(r"(?<![\w./:$@~\\-])((?:" + "|".join(re.escape(r) for r in ROOTS) + r")/[\w.*{},/+-]*)")
PLACEHOLDER_RE = re.compile(r"^[A-Z][A-Z0-9_]+$")
DOC_RE = re.compile(r"(?<![\w./:$@~\\-])((?:[\w-]+/)*[\w-]+\.md)\b`?")
SECTION_RE = re.compile(r"(?:\s*(?:,|and|or|&|–|—|-|/)?\s*)§\s?(\d+(?:\.\d+)*)")
QUOTE_RE = re.compile(r"(?:\s*,\s*|\s+)\(?[\"“]([^\"”]+)[\"”]")
BARE_SECTION_RE = re.compile(r"§\s?(\d+(?:\.\d+)*)")
HEADING_RE = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")
NUMBERED_RE = re.compile(r"^§(\d+(?:\.\d+)*)\.?\s+(.*)$")
COMMENT_PREFIX_RE = re.compile(r"^\s*(?://+|#+|\*+|--|;+)?\s*")
DEFAULT_DOC = "docs/design.md"


def normalise(text):
    text = text.lower().replace("–", "-").replace("—", "-").replace("’", "'").replace("`", "")
    return " ".join(text.split())


def tracked_files(root):
    try:
        out = subprocess.run(["git", "-C", root, "ls-files", "-z"], check=True, capture_output=True).stdout
        files = [f for f in out.decode("utf-8").split("\0") if f]
        if files:
            return files
    except (OSError, subprocess.CalledProcessError):
        pass
    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and not d.startswith("build"))
        for name in sorted(names):
            files.append(os.path.relpath(os.path.join(folder, name), root).replace(os.sep, "/"))
    return files


def expand_braces(path):
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return [e for alt in m.group(1).split(",") for e in expand_braces(path[:m.start()] + alt + path[m.end():])]


class Tree:
    def __init__(self, root, files):
        self.root = root
        self.files = set(files)
        self.dirs = {os.path.dirname(f) for f in files}
        for d in list(self.dirs):
            while d:
                d = os.path.dirname(d)
                self.dirs.add(d)
        self.headings = {}

    def has(self, path):
        path = path.rstrip("/")
        if any(c in path for c in "*?["):
            return any(fnmatch.fnmatchcase(p, path) for p in self.files | self.dirs)
        return path in self.files or path in self.dirs

    def doc_headings(self, doc):
        """[(section number or None, title)] of a markdown document of the tree."""
        if doc not in self.headings:
            found, fenced = [], False
            with open(os.path.join(self.root, doc), encoding="utf-8") as f:
                for line in f:
                    if line.lstrip().startswith("```"):
                        fenced = not fenced
                    m = None if fenced else HEADING_RE.match(line)
                    if m:
                        n = NUMBERED_RE.match(m.group(1))
                        found.append((n.group(1), n.group(2)) if n else (None, m.group(1)))
            self.headings[doc] = found
        return self.headings[doc]

    def numbers_sections(self, doc):
        return any(number for number, _ in self.doc_headings(doc))

    def resolve_doc(self, name):
        for candidate in (name, "docs/" + name):
            if candidate in self.files:
                return candidate
        return None


def file_kind(path, first_line):
    name = os.path.basename(path)
    if name.endswith(".md"):
        return "text"
    if name.endswith(C_LIKE):
        return "c"
    if name.endswith(".py") or (first_line.startswith("#!") and "python" in first_line):
        return "python"
    return "hash"  # shell, CMake, TOML, .gitignore, fuzz dictionaries


def scanned_text(lines, kind):
    """Per line, the part that is prose: all of a document, a comment or a
    docstring of code ('' where the line has none)."""
    if kind == "text":
        return list(lines)
    out, in_block = [], None
    for line in lines:
        if kind == "c":
            text, rest = "", line
            while rest:
                if in_block:
                    end = rest.find("*/")
                    text += " " + (rest if end < 0 else rest[:end])
                    if end < 0:
                        break
                    rest, in_block = rest[end + 2:], None
                    continue
                line_comment = re.search(r"(?<![:\\])//", rest)
                block = rest.find("/*")
                if line_comment and (block < 0 or line_comment.start() < block):
                    text += " " + rest[line_comment.end():]
                    break
                if block < 0:
                    break
                rest, in_block = rest[block + 2:], "*/"
            out.append(text)
        elif kind == "python":
            quotes = len(re.findall(r'"""|\'\'\'', line))
            if in_block or quotes:
                out.append(line)
                if quotes % 2:
                    in_block = None if in_block else "doc"
            else:
                m = re.search(r"(?:^|\s)#", line)
                out.append(line[m.end():] if m else "")
        else:
            m = re.search(r"(?:^|\s)#", line)
            out.append(line[m.end():] if m else "")
    return out


def check_file(tree, path, problems, counts):
    with open(os.path.join(tree.root, path), "rb") as f:
        data = f.read()
    if b"\0" in data[:8192]:
        return
    try:
        lines = data.decode("utf-8").splitlines()
    except UnicodeDecodeError:
        return
    prose = scanned_text(lines, file_kind(path, lines[0] if lines else ""))
    own_doc = path if path.endswith(".md") and tree.numbers_sections(path) else DEFAULT_DOC
    here = os.path.dirname(path)

    def path_exists(cited):
        parts = cited.split("/")
        for i, part in enumerate(parts):
            if PLACEHOLDER_RE.match(part):
                cited = "/".join(parts[:i])
                break
        if cited in BUILD_TREE_PATHS:
            return True
        return all(tree.has(p) or (here and tree.has(here + "/" + p)) for p in expand_braces(cited))

    def section_problem(doc, number, where):
        counts["sections"] += 1
        if not any(n == number for n, _ in tree.doc_headings(doc)):
            problems.append(f"{where}: {doc} has no §{number}")

    for index, line in enumerate(prose):
        if not line.strip():
            continue
        where = f"{path}:{index + 1}"
        following = COMMENT_PREFIX_RE.sub("", prose[index + 1], count=1) if index + 1 < len(prose) else ""
        window = line + " " + following  # a citation may go on in the next (comment) line

        for m in PATH_RE.finditer(line):
            cited = m.group(1)
            if "{" in cited and "}" not in cited[cited.index("{"):]:
                cited = cited[:cited.index("{")]
            if m.end() < len(line) and line[m.end()] in "$<%…":
                cited = cited[:cited.rfind("/") + 1]  # FILE_${x}.cpp, dir/<name>: the folder only
            cited = cited.rstrip(".,;:")
            counts["paths"] += 1
            if not path_exists(cited):
                problems.append(f"{where}: {cited} does not exist")

        consumed = []
        for m in DOC_RE.finditer(line):
            doc = tree.resolve_doc(m.group(1))
            if doc is None:
                continue
            pos, numbers = m.end(), []
            while True:
                s = SECTION_RE.match(window, pos)
                if not s:
                    break
                numbers.append(s.group(1))
                consumed.append((s.start(1), s.end(1)))
                pos = s.end()
            for number in numbers:
                section_problem(doc, number, where)
            q = QUOTE_RE.match(window, pos)
            if q:
                counts["headings"] += 1
                text = normalise(q.group(1))
                candidates = [t for n, t in tree.doc_headings(doc) if not numbers or n == numbers[-1]]
                if not any(normalise(t).startswith(text) for t in candidates):
                    at = f" §{numbers[-1]}" if numbers else ""
                    problems.append(f'{where}: {doc}{at} has no heading starting "{q.group(1)}"')

        for m in BARE_SECTION_RE.finditer(line):
            if any(start <= m.start(1) < end for start, end in consumed):
                continue
            section_problem(own_doc, m.group(1), where)


def main():
    parser = argparse.ArgumentParser(description="Every cited repository path and document section exists.")
    parser.add_argument("--root", default=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                        help="the repository (default: the one holding this script)")
    parser.add_argument("files", nargs="*", help="files to scan, relative to the root (default: the whole tree)")
    args = parser.parse_args()

    root = os.path.abspath(args.root)
    tree = Tree(root, tracked_files(root))
    if DEFAULT_DOC not in tree.files:
        sys.exit(f"check_paths: {root} has no {DEFAULT_DOC}: not an fp4moe tree")
    scan = args.files or sorted(f for f in tree.files
                                if not f.startswith(SKIP_PREFIXES) and not f.endswith(SKIP_SUFFIXES))
    problems, counts = [], {"paths": 0, "sections": 0, "headings": 0}
    for path in scan:
        if os.path.isfile(os.path.join(root, path)):
            check_file(tree, path, problems, counts)
    for p in problems:
        print(p)
    summary = (f"{len(scan)} files: {counts['paths']} paths, {counts['sections']} section and "
               f"{counts['headings']} heading citations")
    if problems:
        print(f"check_paths: {len(problems)} missing ({summary})")
        return 1
    print(f"check_paths: all exist ({summary})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
