# SPDX-License-Identifier: Apache-2.0
"""Every Python block of docs/integration.md runs, in order, in one namespace (the blocks assert
their own results), so the page cannot drift from the package."""

import os
import re

DOC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "docs", "integration.md")


def test_integration_page_python_blocks_run():
    with open(DOC, encoding="utf-8") as f:
        blocks = re.findall(r"^```python\n(.*?)^```$", f.read(), flags=re.S | re.M)
    assert len(blocks) >= 3
    namespace = {}
    for i, block in enumerate(blocks):
        exec(compile(block, f"{DOC}:python block {i + 1}", "exec"), namespace)  # noqa: S102
