#!/usr/bin/env python3
"""The commands quoted in the docs use flags the programs have.

Reads every fenced code block of README.md and docs/*.md, joins continued lines
(a trailing backslash), and splits each line into words as a shell does. A word
naming one of the project's programs (ptrun, gpt_char, gpt_char_cuda,
fashion_mnist, regression, tokenize_text; any path to them) starts that
program's arguments; a launcher of others (torchrun, mpirun, srun, ...) or
another program's path (./train) starts arguments that are not checked, and
a script (python3, bash) ends the line's check. Every --flag (before any `=`)
given to one of the project's programs must appear in that program's --help,
so a renamed or removed flag fails here instead of in a reader's terminal.

    python3 tests/check_doc_flags.py SOURCE_DIR PROGRAM=PATH...
"""
import pathlib
import re
import shlex
import subprocess
import sys

FOREIGN = {"torchrun", "mpirun", "mpiexec", "srun", "sbatch", "kubectl", "docker", "cmake", "env"}
SCRIPTS = {"python", "python3", "bash", "sh"}  # their arguments are a script's, to the end of the line


def help_flags(path):
    """The program's flags, each mapped to whether it takes a value (CLI11's help: `--batch INT`)."""
    out = subprocess.run([path, "--help"], capture_output=True, text=True, timeout=60)
    flags = {}
    for m in re.finditer(r"^\s+(?:-\w,)?(--[\w-]+(?:,--[\w-]+)*)(?:[ \t]+(\S+))?", out.stdout, flags=re.M):
        takes_value = bool(m.group(2) and re.match(r"[A-Z]{2,}", m.group(2)))
        for name in m.group(1).split(","):
            flags[name] = takes_value
    return flags


def code_lines(text):
    """The lines of the fenced blocks, with continuations joined."""
    inside, joined = False, ""
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            inside, joined = not inside, ""
            continue
        if not inside:
            continue
        if line.rstrip().endswith("\\"):
            joined += line.rstrip()[:-1] + " "
            continue
        yield joined + line
        joined = ""


def words(line):
    line = line.split(" #", 1)[0]
    try:
        return shlex.split(line, comments=True)
    except ValueError:
        return line.split()


def main():
    root = pathlib.Path(sys.argv[1])
    programs = dict(arg.split("=", 1) for arg in sys.argv[2:])
    known = {name: help_flags(path) for name, path in programs.items()}
    errors, checked = [], 0
    for doc in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        for line in code_lines(doc.read_text()):
            current, value_next = None, False
            for word in words(line):
                if value_next:  # the value of the flag before it
                    value_next = False
                    continue
                name = pathlib.PurePath(word).name
                if name in SCRIPTS:
                    break
                if name in known:
                    current = name
                elif name in FOREIGN or word in ("|", "&&", ";", "||") or "/" in word and not word.startswith("-"):
                    current = None  # another program (./train), a launcher, or the next command
                elif current and word == "--":
                    current = None  # ptrun's options end; the program's own follow
                elif current and word.startswith("--"):
                    flag = word.split("=", 1)[0]
                    checked += 1
                    value_next = "=" not in word and known[current].get(flag, False)
                    if flag not in known[current]:
                        errors.append(f"{doc.relative_to(root)}: `{current} ... {flag}` but {current} --help has "
                                      f"no {flag}:\n    {line.strip()}")
    for e in errors:
        print(e)
    print(f"{checked} flags in the docs' commands checked against {len(known)} programs' --help: "
          + ("FAILED" if errors else "ok"))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
