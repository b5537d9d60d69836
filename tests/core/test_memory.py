"""release_free_memory hands glibc's freed heap space back to the system."""

import subprocess
import sys
import textwrap


def test_freed_heap_blocks_leave_the_resident_set_only_after_the_release():
    # in a fresh interpreter, so that nothing else of the test session shares its heap
    script = textwrap.dedent("""
        import json
        from flow_assets.core.memory import release_free_memory

        def rss():
            with open("/proc/self/status") as f:
                return next(int(l.split()[1]) for l in f if l.startswith("VmRSS")) * 1024

        # 100 KB blocks: below glibc's mmap threshold, so they live in the heap, and the last
        # one stays live so the heap's top cannot shrink by itself
        blocks = [bytearray(100_000) for _ in range(3000)]
        keep = blocks[-1]
        start = rss()
        del blocks
        freed = rss()
        released = release_free_memory()
        print(json.dumps({"start": start, "freed": freed, "after": rss(), "released": released}))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    import json

    m = json.loads(out)
    if not sys.platform.startswith("linux"):
        assert m["released"] is False
        return
    assert m["freed"] > m["start"] - 50e6  # freeing alone keeps most of the 300 MB resident
    assert m["released"] and m["after"] < m["freed"] - 200e6  # the release gives it back
