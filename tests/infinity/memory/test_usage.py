"""What the process uses, read from /proc/self/status: one reader for every figure."""

import builtins
import mmap

from infinity.memory import peak_rss_bytes, rss_bytes, rss_parts


def test_the_resident_set_is_its_parts_and_touched_pages_grow_the_anonymous_one():
    before = rss_parts()
    assert set(before) == {"VmRSS", "RssAnon", "RssFile", "RssShmem"}
    assert before["VmRSS"] == before["RssAnon"] + before["RssFile"] + before["RssShmem"]
    # new private anonymous pages, whatever the heap already holds (Python's default for an
    # anonymous mmap is shared: RssShmem)
    with mmap.mmap(-1, 64 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) as fresh:
        for offset in range(0, len(fresh), mmap.PAGESIZE):
            fresh[offset] = 1
        after = rss_parts()
        assert after["RssAnon"] - before["RssAnon"] >= 60 << 20
        assert after["VmRSS"] <= peak_rss_bytes() and rss_bytes() >= after["VmRSS"] - (8 << 20)


def test_without_proc_every_figure_is_zero(monkeypatch):
    real_open = builtins.open

    def no_proc(path, *args, **kwargs):
        if str(path).startswith("/proc/"):
            raise FileNotFoundError(path)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", no_proc)
    assert rss_bytes() == peak_rss_bytes() == 0
    assert rss_parts() == {"VmRSS": 0, "RssAnon": 0, "RssFile": 0, "RssShmem": 0}
