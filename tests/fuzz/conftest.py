"""The fuzz tests' summary: how many inputs each target tried (helpers: fuzz_support.py, a
module name no other test folder uses)."""

from fuzz_support import TRIED


def pytest_terminal_summary(terminalreporter):
    if TRIED:
        terminalreporter.section("fuzz inputs tried per target")
        for target, n in sorted(TRIED.items()):
            terminalreporter.write_line(f"{target:40s} {n}")
