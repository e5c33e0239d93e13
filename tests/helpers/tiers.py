"""The two test tiers: `python -m pytest --quick` runs every test not marked `slow`, and the tests
that carry the product's promises (marked `promise`) may never be slow or missing.

A promise is a name from PROMISES put on a test with `@pytest.mark.promise("name")` (or on a module
with `pytestmark`). When the whole suite is collected, each promise must be carried by at least
one collected test that is not slow, so no edit can quietly move a promise out of the quick tier.
"""

from __future__ import annotations

import os

import pytest

# promise -> what the tests carrying it prove (README "Set up on a fresh machine" lists the files)
PROMISES = {
    **{f"greedy-lossless:{method}": f"greedy tokens identical with and without {method} "
                                    f"speculation on a tiny target, drafts accepted"
       for method in ("ngram", "suffix", "draft_model", "eagle", "eagle3", "mlp_speculator",
                      "medusa", "mtp", "adaptive")},
    **{f"greedy-lossless-tree:{method}": f"greedy tokens identical with {method} draft trees on "
                                         f"a tiny target, drafts accepted"
       for method in ("ngram", "suffix", "eagle", "eagle3", "medusa", "mtp")},
    "greedy-lossless-families": "every proposer and draft tree lossless on tiny Qwen3 and Gemma 3 "
                                "targets",
    "serve-default-real-model": "the embedded model as served by default (packed weights, batched, "
                                "preempted, prefix cache on) keeps its greedy tokens speculating",
    "packed-kernel-exact": "the packed-weight kernels equal the float32 kernel bit for bit, and the "
                           "engine on packed weights the float32 engine",
    "sampling-law": "sampled tokens follow the target distribution through the whole engine",
    "sampling-law-canaries": "broken samplers fail the same statistical check, at full size",
    "api-contract-sdk": "the OpenAI API contract through the openai SDK on a live server",
    "bad-input-400": "malformed requests get an OpenAI-style 4xx naming the problem, never a 500",
    "failure-isolation": "a request that fails inside the step fails alone; a dead engine fails "
                         "every request and the server",
}

QUICK_ENV = "SPECSERVE_QUICK_TESTS"
_QUICK_BEFORE = pytest.StashKey[str | None]()


def is_quick() -> bool:
    """True under `--quick` (helpers size statistical checks by it; set before collection)."""
    return os.environ.get(QUICK_ENV) == "1"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--quick", action="store_true", default=False,
                     help="the quick tier: skip tests marked slow (the promises always run) and "
                          "size the sampling law's checks at lower power, its canaries unchanged")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: left out of the quick tier (`--quick`)")
    config.addinivalue_line("markers", "promise(name): this test carries a product promise "
                                       "(tests/helpers/tiers.py PROMISES); never slow")
    config.stash[_QUICK_BEFORE] = os.environ.get(QUICK_ENV)
    if config.getoption("quick"):
        os.environ[QUICK_ENV] = "1"


def pytest_unconfigure(config: pytest.Config) -> None:
    """Put the flag back (a run inside a run, as tests/test_tiers.py makes, must not leak it)."""
    before = config.stash.get(_QUICK_BEFORE, None)
    if before is None:
        os.environ.pop(QUICK_ENV, None)
    else:
        os.environ[QUICK_ENV] = before


def _promises_of(item: pytest.Item) -> list[str]:
    return [name for mark in item.iter_markers("promise") for name in mark.args]


def _collects_whole_suite(config: pytest.Config) -> bool:
    """True when the run names no paths (pytest's testpaths), or only the suite's root or its
    tests folder, with no -k or -m: then every promise must be found. A run of one folder or file
    checks only what it collected."""
    whole = {os.path.realpath(config.rootpath), os.path.realpath(config.rootpath / "tests")}
    paths = [os.path.realpath(config.invocation_params.dir / arg.split("::")[0])
             for arg in config.args]
    return (all(path in whole for path in paths) and not config.getoption("keyword")
            and not config.getoption("markexpr"))


def check_promises(items: list[pytest.Item], whole_suite: bool) -> list[str]:
    """Problems with the promises among `items`: unknown names, promises on slow tests and (for
    the whole suite) promises no quick test carries."""
    problems = []
    carried: set[str] = set()
    for item in items:
        names = _promises_of(item)
        for name in names:
            if name not in PROMISES:
                problems.append(f"{item.nodeid}: unknown promise {name!r}")
            elif item.get_closest_marker("slow") is not None:
                problems.append(f"{item.nodeid} carries the promise {name!r} but is marked slow")
            else:
                carried.add(name)
    if whole_suite:
        problems += [f"no quick test carries the promise {name!r} ({PROMISES[name]})"
                     for name in PROMISES if name not in carried]
    return problems


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    problems = check_promises(items, _collects_whole_suite(config))
    if problems:
        raise pytest.UsageError("the quick tier lost a promise:\n  " + "\n  ".join(problems))
    if not config.getoption("quick"):
        return
    slow = [item for item in items if item.get_closest_marker("slow") is not None]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if item.get_closest_marker("slow") is None]


def tiered(values, quick: set, promise: str | None = None) -> list:
    """Parameters for `pytest.mark.parametrize`: those in `quick` run in the quick tier (carrying
    `promise`, if given), the others are marked slow."""
    marks = [pytest.mark.promise(promise)] if promise else []
    unknown = set(quick) - set(values)
    if unknown:
        raise ValueError(f"quick values not among the parameters: {sorted(unknown)}")
    return [pytest.param(value, marks=marks if value in quick else [pytest.mark.slow])
            for value in values]
