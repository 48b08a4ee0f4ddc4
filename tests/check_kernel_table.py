#!/usr/bin/env python3
"""One kernel layer, two devices: every CPU kernel has a CUDA twin in the kernel table.

Reads the functions defined at namespace scope in ptrain::kernels::cpu
(include/ptrain/kernels/cpu/*.hpp, not in a nested `detail` namespace), the
members of kernels::CudaKernels (kernels/cuda_table.hpp) and the assignments
in src/cuda_register.cu, and fails when
  - a CPU kernel has no table member and is not on the CPU-only list in
    docs/cuda.md ("### CPU-only kernels", one `name` per table row, with why);
  - a name on the CPU-only list is not a CPU kernel (the list goes stale), or
    has a table member after all;
  - a table member is never assigned in src/cuda_register.cu (every call would
    throw [ptrain.cuda.unsupported]);
  - a name on the verification gate's list (kernels/cuda_unverified.hpp) is
    missing from docs/cuda.md's table of gated names.

    python3 tests/check_kernel_table.py [repository root]
"""
import pathlib
import re
import sys

root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).resolve().parents[1])

# A function definition at column 0: a return type, then the name and "(".
FUNCTION = re.compile(r"^(?:inline\s+|constexpr\s+)*(?!(?:return|if|for|while|using|namespace|struct|class|enum|"
                      r"template)\b)[A-Za-z_][\w:<>,\s*&]*?[\s*&]([a-z_]\w*)\(")
# CPU kernels the table holds under other names.
TABLE_NAMES = {"cast": ["cast_to_bf16", "cast_from_bf16"]}


def cpu_kernels():
    found = {}
    for path in sorted((root / "include/ptrain/kernels/cpu").glob("*.hpp")):
        namespaces = []
        for line in path.read_text().splitlines():
            opened = re.match(r"^namespace ([\w:]+) \{", line)
            if opened:
                namespaces.append(opened.group(1))
            elif re.match(r"^\}\s*//\s*namespace", line):
                namespaces.pop()
            elif namespaces and namespaces[-1] == "ptrain::kernels::cpu":
                m = FUNCTION.match(line)
                if m:
                    found.setdefault(m.group(1), path.name)
    return found


def table_members():
    text = (root / "include/ptrain/kernels/cuda_table.hpp").read_text()
    start = text.index("struct CudaKernels {")
    return set(re.findall(r"\(\*(\w+)\)\(", text[start:text.index("\n};", start)]))


def doc_section_names(heading):
    """The `name`s in the first column of the table under `heading` in docs/cuda.md (several to a row)."""
    text = (root / "docs/cuda.md").read_text()
    if heading not in text:
        return None
    section = text[text.index(heading) + len(heading):]
    section = re.split(r"\n#{2,3} ", section, maxsplit=1)[0]
    names = set()
    for first_cell in re.findall(r"^\|([^|]*)\|", section, flags=re.M):
        names.update(re.findall(r"`(\w+)`", first_cell))
    return names


def main():
    errors = []
    kernels, members = cpu_kernels(), table_members()
    cpu_only = doc_section_names("### CPU-only kernels")
    if cpu_only is None:
        errors.append('docs/cuda.md has no "### CPU-only kernels" section')
        cpu_only = set()
    for name, header in sorted(kernels.items()):
        twins = TABLE_NAMES.get(name, [name])
        if not all(t in members for t in twins) and name not in cpu_only:
            errors.append(f"kernels::cpu::{name} ({header}) has no CUDA table entry: add a CUDA twin to "
                          "kernels/cuda_table.hpp and src/cuda_register.cu, or list it under "
                          "\"### CPU-only kernels\" in docs/cuda.md with the reason")
    for name in sorted(cpu_only):
        if name not in kernels:
            errors.append(f"docs/cuda.md lists {name} as a CPU-only kernel, but kernels/cpu has no such function")
        elif name in members:
            errors.append(f"docs/cuda.md lists {name} as CPU-only, but the CUDA table has it: take it off the list")
    register = (root / "src/cuda_register.cu").read_text()
    for name in sorted(members):
        if not re.search(rf"\.{name}\s*=", register):
            errors.append(f"CudaKernels::{name} is never assigned in src/cuda_register.cu")
    gate = (root / "include/ptrain/kernels/cuda_unverified.hpp").read_text()
    gate = gate[gate.index("kUnverifiedCuda = {"):]
    gated = re.findall(r'^\s*"(\w+)",', gate[:gate.index("\n};")], flags=re.M)
    documented = doc_section_names("### The verification gate") or set()
    for name in gated:
        if name not in documented:
            errors.append(f"{name} is gated (kernels/cuda_unverified.hpp) but missing from the table of gated names "
                          "in docs/cuda.md (\"### The verification gate\")")
    if len(set(gated)) != len(gated):
        errors.append("kernels/cuda_unverified.hpp names a kernel twice")
    for e in errors:
        print(e)
    print(f"{len(kernels)} CPU kernels, {len(members)} table members, {len(cpu_only)} CPU-only, {len(gated)} gated: "
          + ("FAILED" if errors else "ok"))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
