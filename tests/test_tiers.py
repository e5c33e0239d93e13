"""The quick tier leaves out slow tests and refuses to start when a promise is slow or missing."""

from __future__ import annotations

import pytest
from tiers import PROMISES

pytest_plugins = ["pytester"]

CONFTEST = "pytest_plugins = ['tiers']\n"


def promise_module(names: list[str], slow: set[str] = frozenset()) -> str:
    lines = ["import pytest", ""]
    for i, name in enumerate(names):
        lines += [f"@pytest.mark.promise({name!r})"]
        lines += ["@pytest.mark.slow"] if name in slow else []
        lines += [f"def test_promise_{i}():", "    pass", ""]
    return "\n".join(lines)


@pytest.fixture
def suite(pytester: pytest.Pytester):
    """A suite laid out as ours is (its tests under tests/), run with the tiers plugin."""
    pytester.makeconftest(CONFTEST)
    pytester.makeini("[pytest]\ntestpaths = tests\n")
    tests = pytester.mkpydir("tests")
    (tests / "__init__.py").unlink()
    (tests / "test_plain.py").write_text(
        "import pytest\n\ndef test_fast():\n    pass\n\n"
        "@pytest.mark.slow\ndef test_slow():\n    pass\n")
    return pytester


def test_quick_deselects_slow_tests_and_keeps_the_promises(suite):
    (suite.path / "tests" / "test_promises.py").write_text(promise_module(list(PROMISES)))
    result = suite.runpytest("--quick", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1 + len(PROMISES), deselected=1)
    result = suite.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2 + len(PROMISES))


def test_a_slow_promise_fails_collection(suite):
    name = next(iter(PROMISES))
    (suite.path / "tests" / "test_promises.py").write_text(
        promise_module(list(PROMISES), slow={name}))
    result = suite.runpytest("--quick", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*carries the promise {name!r} but is marked slow*"])


def test_a_missing_promise_fails_the_whole_suite_but_not_one_folder(suite):
    missing = list(PROMISES)[-1]
    (suite.path / "tests" / "test_promises.py").write_text(promise_module(list(PROMISES)[:-1]))
    result = suite.runpytest("-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*no quick test carries the promise {missing!r}*"])
    # one file alone does not hold every promise, and is not asked to
    result = suite.runpytest("-p", "no:cacheprovider", "tests/test_plain.py")
    result.assert_outcomes(passed=2)


def test_an_unknown_promise_fails_collection(suite):
    (suite.path / "tests" / "test_promises.py").write_text(
        promise_module([*PROMISES, "no-such-promise"]))
    result = suite.runpytest("-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*unknown promise 'no-such-promise'*"])
