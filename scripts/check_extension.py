#!/usr/bin/env python3
"""Checks that a built fp4moe extension (fp4moe/_fp4moe*.so) uses the C++
runtime of the process it is loaded into, and prints what it links.

    scripts/check_extension.py [--check] [--remove-on-failure] [--out FILE] EXTENSION.so

The extension must link libstdc++ and libgcc_s dynamically. A static copy of
libstdc++ inside it (-static-libstdc++, or a g++ that finds only
libstdc++.a) sits next to the libstdc++.so.6 that NumPy and torch load: the
two disagree on std::locale's facet ids, and the first iostream number
formatting in the extension crashes (a segmentation fault in
std::basic_ostream::_M_insert<long>). The signs, read with binutils:

  readelf -d    NEEDED lacks libstdc++.so.6 (the whole library is static)
  nm -D         the extension defines libstdc++'s or libgcc's own symbols:
                std::locale and its facet ids, std::ios_base (Init),
                std::codecvt, the iostream objects and ostream inserters,
                the __cxa_* / __gxx_personality_v0 ABI runtime,
                std::__throw_*, _Unwind_*

Only strong definitions count. Weak and unique symbols are what template
instantiations and inline functions of the headers become in any
translation unit that uses them (std::vector<...>, std::regex internals,
std::ctype<char>::do_widen, nanobind's): normal. The library's own
non-inline members and explicit instantiations are strong in libstdc++ and
never emitted by user code (the headers declare them extern).

Prints the report (NEEDED, RUNPATH, the offending symbols, the defined
std:: symbols by kind) to stdout and to --out. With --check, exits 1 when
the extension fails the rule (and with --remove-on-failure deletes it, so
that a build tree does not keep a bad module as up to date). Used by
python/CMakeLists.txt after every link of the module, by
tests/python/test_extension.py and by tools/lab/gpu-python.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys

# Mangled-name patterns of symbols only libstdc++ (libsupc++ included) or
# libgcc define; an extension that defines any of them carries a copy.
RUNTIME_SYMBOLS = [
    (re.compile(r"^_ZN?K?St6locale"), "std::locale"),
    (re.compile(r"^_ZN?K?St8ios_base"), "std::ios_base"),
    (re.compile(r"^_ZN?K?St7codecvt"), "std::codecvt"),
    (re.compile(r"^_ZN?K?St(?:7num_put|7num_get|8numpunct|5ctype)I"), "locale facets"),
    (re.compile(r"^_ZN?K?S[oi](?:9_M_insert|lsE|rsE|C[12]E|D[012]E)"), "std::ostream/std::istream members"),
    (re.compile(r"^_ZSt(?:4cout|4cerr|4clog|3cin)$"), "the iostream objects"),
    (re.compile(r"^_ZSt\d+__throw_"), "std::__throw_* helpers"),
    (re.compile(r"^__cxa_"), "the C++ ABI runtime (__cxa_*)"),
    (re.compile(r"^__gxx_personality_v0$"), "the C++ exception personality"),
    (re.compile(r"^_ZTVN10__cxxabiv1"), "the C++ ABI type_info vtables"),
    (re.compile(r"^_Unwind_"), "libgcc's unwinder (_Unwind_*)"),
]

# nm's letters of weak (W, w, V, v) and unique (u) symbols: what template
# instantiations and inline functions become.
WEAK_KINDS = set("WwVvu")

REQUIRED_NEEDED = "libstdc++.so.6"


def _tool(name: str, given: str | None) -> str | None:
    if given:
        return given if os.path.isfile(given) or shutil.which(given) else None
    return shutil.which(name)


def _run(args: list[str]) -> str:
    return subprocess.run(args, check=True, capture_output=True, text=True).stdout


def needed_and_runpath(readelf: str, path: str) -> tuple[list[str], list[str]]:
    needed, runpath = [], []
    for line in _run([readelf, "-d", "-W", path]).splitlines():
        m = re.search(r"\((NEEDED|RPATH|RUNPATH)\).*\[(.*)\]", line)
        if m:
            (needed if m.group(1) == "NEEDED" else runpath).append(m.group(2))
    return needed, runpath


def defined_dynamic_symbols(nm: str, path: str) -> list[tuple[str, str]]:
    """(type letter, mangled name) of every defined dynamic symbol."""
    out = []
    for line in _run([nm, "-D", "--defined-only", path]).splitlines():
        parts = line.split()
        if len(parts) >= 3:
            out.append((parts[1], parts[2]))
    return out


def runtime_symbols(symbols: list[tuple[str, str]]) -> list[tuple[str, str, str]]:
    """(type, name, what) of the symbols among `symbols` ((nm type, mangled
    name)) that only libstdc++ or libgcc define, the most telling first.
    Strong definitions only: inline members and helpers of the headers
    (std::ctype<char>::do_widen, std::__throw_regex_error) are emitted weak
    by any translation unit that uses them."""
    found = [(rank, kind, name, what) for kind, name in symbols if kind not in WEAK_KINDS
             for rank, (pattern, what) in enumerate(RUNTIME_SYMBOLS) if pattern.match(name)]
    return [(kind, name, what) for _, kind, name, what in sorted(found)]


def demangle(names: list[str]) -> list[str]:
    cxxfilt = shutil.which("c++filt")
    if not cxxfilt or not names:
        return names
    result = subprocess.run([cxxfilt], input="\n".join(names), capture_output=True, text=True)
    lines = result.stdout.splitlines()
    return lines if result.returncode == 0 and len(lines) == len(names) else names


class Report:
    def __init__(self, path: str, nm: str | None = None, readelf: str | None = None):
        self.path = path
        nm_tool, readelf_tool = _tool("nm", nm), _tool("readelf", readelf)
        if nm_tool is None or readelf_tool is None:
            raise FileNotFoundError("nm and readelf (binutils) are needed to inspect the extension")
        self.needed, self.runpath = needed_and_runpath(readelf_tool, path)
        self.symbols = defined_dynamic_symbols(nm_tool, path)
        self.offending = runtime_symbols(self.symbols)

    @property
    def problems(self) -> list[str]:
        problems = []
        if REQUIRED_NEEDED not in self.needed:
            problems.append(f"NEEDED lacks {REQUIRED_NEEDED}: the extension does not use the shared libstdc++ "
                            f"(NEEDED: {', '.join(self.needed) or 'none'})")
        if self.offending:
            kinds = sorted({what for _, _, what in self.offending})
            problems.append(f"the extension defines {len(self.offending)} symbol(s) of libstdc++/libgcc itself "
                            f"({'; '.join(kinds)}): a static copy of the C++ runtime is linked in")
        return problems

    def text(self) -> str:
        lines = [f"extension: {self.path}",
                 f"NEEDED: {', '.join(self.needed) or '(none)'}",
                 f"RUNPATH/RPATH: {', '.join(self.runpath) or '(none)'}"]
        std = [(kind, name) for kind, name in self.symbols if name.startswith(("_ZNSt", "_ZNKSt", "_ZSt"))]
        by_kind: dict[str, int] = {}
        for kind, _ in std:
            by_kind[kind] = by_kind.get(kind, 0) + 1
        lines.append(f"defined dynamic symbols: {len(self.symbols)}; in namespace std: {len(std)} "
                     f"(by nm type: {', '.join(f'{k} {n}' for k, n in sorted(by_kind.items())) or 'none'}; "
                     "weak W/V and unique u are template instantiations)")
        if self.offending:
            names = demangle([name for _, name, _ in self.offending])
            lines.append(f"libstdc++/libgcc symbols defined in the extension ({len(self.offending)}), e.g.:")
            lines += [f"  {kind} {name}" for (kind, _, _), name in list(zip(self.offending, names))[:25]]
        else:
            lines.append("libstdc++/libgcc symbols defined in the extension: none")
        problems = self.problems
        lines.append("verdict: " + ("OK (libstdc++ is the process's shared one)" if not problems
                                    else "BROKEN: " + "; ".join(problems)))
        return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("extension")
    parser.add_argument("--check", action="store_true", help="exit 1 when the extension fails the rule")
    parser.add_argument("--remove-on-failure", action="store_true", help="with --check: delete a failing extension")
    parser.add_argument("--out", help="also write the report here")
    parser.add_argument("--nm", help="the nm to use (default: nm on PATH)")
    parser.add_argument("--readelf", help="the readelf to use (default: readelf on PATH)")
    parser.add_argument("--quiet", action="store_true", help="print the report only when the check fails")
    args = parser.parse_args()
    try:
        report = Report(args.extension, args.nm, args.readelf)
    except FileNotFoundError as e:
        print(f"check_extension: {e}; not checked", file=sys.stderr)
        return 0
    text = report.text()
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    failed = args.check and bool(report.problems)
    if not args.quiet or failed:
        sys.stdout.write(text)
    if failed:
        print("fp4moe: the extension links a static C++ runtime; it would crash next to NumPy/torch's "
              "libstdc++.so.6. Look for -static-libstdc++/-static-libgcc in LDFLAGS, CMAKE_*_LINKER_FLAGS or "
              "AUDITWHEEL_PLAT=musllinux*, a g++ without its libstdc++.so (only libstdc++.a installed), or a "
              "linked static library that carries libstdc++ objects; the link line is in the build log "
              "(CMAKE_BUILD_PARALLEL_LEVEL=1, pip -v).", file=sys.stderr)
        if args.remove_on_failure:
            os.remove(args.extension)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
