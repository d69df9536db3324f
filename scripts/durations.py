"""Where a test run's time went, from its JUnit XML (scripts/test.sh writes one per run): the time per file (setup,
call and teardown summed over its tests) and the slowest tests, as the markdown tables of docs/DEVELOPING.md.

Run: python scripts/durations.py RUN.xml [--files 25] [--tests 40]
"""
import argparse
import collections
import xml.etree.ElementTree as ET


def read(path: str) -> list[tuple[str, float]]:
    """[(test id as pytest names it, seconds)] of every test case in the report."""
    out = []
    for case in ET.parse(path).getroot().iter("testcase"):
        cls, name = case.get("classname", ""), case.get("name", "")
        parts = cls.split(".")
        module = "/".join(parts[:-1] if parts and parts[-1][:1].isupper() else parts)  # tests.test_x[.Class]
        out.append((f"{module.split('/')[-1]}.py::{name}", float(case.get("time", 0.0))))
    return out


def tables(cases: list[tuple[str, float]], n_files: int = 25, n_tests: int = 40) -> str:
    per_file = collections.Counter()
    for test, s in cases:
        per_file[test.split("::")[0]] += s
    lines = ["| file | s |", "|---|---:|"]
    top = per_file.most_common(n_files)
    lines += [f"| `{f}` | {s:.0f} |" for f, s in top]
    rest = [s for f, s in per_file.items() if f not in dict(top)]
    if rest:
        lines.append(f"| the other {len(rest)} files | {sum(rest):.0f} |")
    lines += ["", f"The slowest {n_tests} tests (s):", "", "| test | s |", "|---|---:|"]
    lines += [f"| `{t}` | {s:.0f} |" for t, s in sorted(cases, key=lambda c: -c[1])[:n_tests]]
    total = sum(s for _, s in cases)
    lines += ["", f"{len(cases)} tests, their times summed: {total:.0f} s"]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("xml")
    ap.add_argument("--files", type=int, default=25)
    ap.add_argument("--tests", type=int, default=40)
    a = ap.parse_args()
    print(tables(read(a.xml), a.files, a.tests))


if __name__ == "__main__":
    main()
