"""scripts/durations.py: the per-file and slowest-test tables from a JUnit XML report (values summed by hand)."""
import importlib.util

from pack_import import ROOT

XML = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="4">
<testcase classname="tests.test_a" name="test_one" time="10.4" />
<testcase classname="tests.test_a" name="test_two[x]" time="2.0" />
<testcase classname="tests.test_b.TestThing" name="test_three" time="30.0" />
<testcase classname="tests.test_c" name="test_four" time="1.0" />
</testsuite></testsuites>"""


def _durations():
    spec = importlib.util.spec_from_file_location("durations", ROOT / "scripts" / "durations.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_tables_from_a_junit_report(tmp_path):
    durations = _durations()
    p = tmp_path / "run.xml"
    p.write_text(XML)
    cases = durations.read(str(p))
    assert cases == [("test_a.py::test_one", 10.4), ("test_a.py::test_two[x]", 2.0),
                     ("test_b.py::test_three", 30.0), ("test_c.py::test_four", 1.0)]
    out = durations.tables(cases, n_files=2, n_tests=2).splitlines()
    assert out[2:5] == ["| `test_b.py` | 30 |", "| `test_a.py` | 12 |", "| the other 1 files | 1 |"]
    assert out[10:12] == ["| `test_b.py::test_three` | 30 |", "| `test_a.py::test_one` | 10 |"]
    assert out[-1] == "4 tests, their times summed: 43 s"
