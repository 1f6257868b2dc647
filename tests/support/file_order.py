"""The order the suite's test files run in: the longest first.

``scripts/test.sh`` hands out whole files to its two workers (pytest-xdist ``--dist loadfile``) in the order
``tests/conftest.py`` leaves them (``--no-loadscope-reorder``; pytest-xdist would otherwise sort them by test
count, which put the long one-test engine files last, where one worker ran them while the other idled).
"""

from __future__ import annotations

# Wall seconds of each long test file in a full fresh-clone run (scripts/test.sh, two workers, 2 cores), its
# session fixtures included: the --durations of that run, about 10 s for each engine test it did not list. Every
# other file takes a few seconds; they run last, filling in while the other worker ends its file.
FILE_SECONDS = {
    "tests/sglang/test_sglang_engine.py": 480,
    "tests/vllm/test_vllm_engine.py": 330,
    "tests/vllm/test_vllm_data_parallel.py": 221,
    "tests/vllm/test_vllm_tensor_parallel.py": 169,
    "tests/vllm/test_vllm_architectures.py": 150,
    "tests/vllm/test_vllm_kubernetes.py": 125,  # not in that run: measured alone (the export, then the serve, compiled)
    "tests/vllm/test_vllm_derived_cache.py": 112,
    "tests/vllm/test_vllm_serve.py": 99,
    "tests/sglang/test_sglang_architectures.py": 70,
    "tests/cache/test_cache_crash.py": 35,
    "tests/core/test_install.py": 35,  # not in that run: measured alone (a wheel, a fresh environment, its install)
}
# While scripts/test.sh still builds the SGLang environment in the background (COLDSNAP_SGLANG_SETUP_STATUS), the
# files whose engines need it start only after this many declared seconds of other files (both workers together:
# about half of it in wall time), so the build has the vLLM set-up, the lint and those files' time to finish in
# (a worker that reaches them earlier waits for it: tests/sglang/sglang_support.py).
SGLANG_AFTER_SECONDS = 900


def file_order(test_counts: dict[str, int], *, waiting_for_sglang: frozenset[str] = frozenset()) -> list[str]:
    """The test files (``nodeid`` paths -> their number of selected tests, in collection order) longest first
    by :data:`FILE_SECONDS`, the others after them by test count, more first (what pytest-xdist's own reordering
    does); the files in ``waiting_for_sglang`` (while the SGLang environment is still being built) move behind the
    first :data:`SGLANG_AFTER_SECONDS` declared seconds of the others."""
    order = sorted(test_counts, key=lambda path: (-FILE_SECONDS.get(path, 0), -test_counts[path]))
    waiting = [path for path in order if path in waiting_for_sglang]
    others = [path for path in order if path not in waiting_for_sglang]
    handed_out, at = 0, len(others)
    for index, path in enumerate(others):
        if handed_out >= SGLANG_AFTER_SECONDS:
            at = index
            break
        handed_out += FILE_SECONDS.get(path, 0)
    return others[:at] + waiting + others[at:]
