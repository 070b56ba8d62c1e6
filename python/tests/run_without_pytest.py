# SPDX-License-Identifier: Apache-2.0
"""Runs test modules of this folder where pytest is not installed (a GPU machine without network access,
say): ``python3 python/tests/run_without_pytest.py test_ops_cuda [test_ops ...]``, with the kvmem package
on PYTHONPATH. It stands in for the part of pytest these modules use (``raises`` with ``match``, ``skip``,
``mark.parametrize``), runs every ``test_*`` function in file order and prints one line each; the exit
status is 1 when a test failed. pytest remains the runner of record (ctest's python_ops)."""

import contextlib
import importlib
import os
import re
import sys
import traceback
import types


class Skipped(Exception):
    pass


def skip(reason="", allow_module_level=False):  # noqa: ARG001 (pytest's signature)
    raise Skipped(reason)


@contextlib.contextmanager
def raises(kind, match=None):
    info = types.SimpleNamespace(value=None)
    try:
        yield info
    except kind as e:
        info.value = e
        if match is not None and not re.search(match, str(e)):
            raise AssertionError(f"{kind.__name__} raised, but {match!r} does not match {str(e)!r}") from e
        return
    raise AssertionError(f"{kind.__name__} was not raised")


def parametrize(name, values):
    def mark(f):
        f.kvmem_params = (name, list(values))
        return f
    return mark


def install():
    module = types.ModuleType("pytest")
    module.skip, module.raises = skip, raises
    module.mark = types.SimpleNamespace(parametrize=parametrize)
    sys.modules["pytest"] = module


def run(name):
    """Runs one test module; returns the number of failed tests."""
    try:
        mod = importlib.import_module(name)
    except Skipped as e:
        print(f"{name}: skipped: {e}")
        return 0
    failed = 0
    tests = [(n, f) for n, f in vars(mod).items() if n.startswith("test_") and callable(f)]
    for test_name, f in tests:
        name_of_param, values = getattr(f, "kvmem_params", (None, [None]))
        for value in values:
            label = f"{name}::{test_name}" + (f"[{value}]" if name_of_param else "")
            try:
                f(**({name_of_param: value} if name_of_param else {}))
                print(f"PASSED  {label}")
            except Skipped as e:
                print(f"SKIPPED {label}: {e}")
            except Exception:  # noqa: BLE001 (every failure is reported, then the next test runs)
                failed += 1
                print(f"FAILED  {label}")
                traceback.print_exc()
    return failed


def main(names):
    install()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    failed = sum(run(n) for n in names or ["test_ops_cuda"])
    print(f"{failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
