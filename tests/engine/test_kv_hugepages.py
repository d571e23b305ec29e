"""A CPU KV cache is advised onto 2 MB pages (MADV_HUGEPAGE) before it is first
touched: attention reads its blocks from anywhere in it, and with 4 KB pages a decode
step misses the TLB at nearly every block. The advice shows in the mapping's VmFlags
("hg") in /proc/self/smaps; SPECSERVE_KV_HUGEPAGES=0 leaves it off. The cache is zeroed
either way."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from engine.attention import advise_huge_pages, allocate_kv_caches

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not THP.exists() or "[never]" in THP.read_text(),
    reason="transparent huge pages are not available on this host",
)


def _vm_flags(address: int) -> set[str]:
    """The VmFlags of the mapping that holds ``address``."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        m = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if m:
            inside = int(m.group(1), 16) <= address < int(m.group(2), 16)
        elif inside and line.startswith("VmFlags:"):
            return set(line.split(":", 1)[1].split())
    raise AssertionError(f"no mapping holds {address:#x}")


def _cache(monkeypatch, setting: str | None) -> list[torch.Tensor]:
    if setting is None:
        monkeypatch.delenv("SPECSERVE_KV_HUGEPAGES", raising=False)
    else:
        monkeypatch.setenv("SPECSERVE_KV_HUGEPAGES", setting)
    # 2 layers x 2 x 256 blocks x 16 x 4 x 64 fp32: 32 MB, many 2 MB pages
    return allocate_kv_caches(2, 256, 16, 4, 64, torch.float32, "cpu")


def test_the_cache_is_advised_onto_huge_pages_and_zeroed(monkeypatch):
    caches = _cache(monkeypatch, None)
    middle = caches[0].data_ptr() + caches[0].numel() * caches[0].element_size() // 2
    assert "hg" in _vm_flags(middle)
    assert all(int(torch.count_nonzero(c)) == 0 for c in caches)


def test_the_environment_turns_the_advice_off(monkeypatch):
    """With SPECSERVE_KV_HUGEPAGES=0 the cache is not advised at all. (Its mapping's flags
    cannot show that: the allocator may hand back memory an earlier, advised cache of
    the same process left marked.)"""
    import engine.attention as attention

    advised = []
    real = attention.advise_huge_pages
    monkeypatch.setattr(attention, "advise_huge_pages", lambda t: advised.append(t) or real(t))
    caches = _cache(monkeypatch, "0")
    assert advised == []
    assert all(int(torch.count_nonzero(c)) == 0 for c in caches)
    _cache(monkeypatch, "1")
    assert len(advised) == 1


def test_a_tensor_without_a_whole_page_is_left_alone():
    assert advise_huge_pages(torch.empty(0)) is False
    big = torch.empty(4 * 4096)
    # a 16-float view that starts past a page boundary and ends before the next one
    first = next(i for i in range(4096) if 16 <= (big.data_ptr() + 4 * i) % 4096 <= 4000)
    assert advise_huge_pages(big[first : first + 16]) is False
    assert advise_huge_pages(big) is True  # whole pages inside: advised
