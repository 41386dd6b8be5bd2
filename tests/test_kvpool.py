"""The numpy allocators: paired alloc/free, None when short, loud on misuse, leak checks."""

from __future__ import annotations

import numpy as np
import pytest

from mlxserve.kvpool import ReqToTokenPool, TokenToKVPoolAllocator


class TestTokenAllocator:
    def test_alloc_and_free_round_trip(self):
        a = TokenToKVPoolAllocator(10)
        ids = a.alloc(4)
        assert ids is not None and len(ids) == 4, ids
        assert 0 not in ids, "the padding slot must never be handed out"
        assert a.available_size() == 6
        a.free(ids)
        assert a.available_size() == 10
        a.check_integrity([])

    def test_returns_none_when_short_and_takes_nothing(self):
        a = TokenToKVPoolAllocator(3)
        assert a.alloc(4) is None
        assert a.available_size() == 3, "a failed alloc must not take slots"

    def test_double_free_and_foreign_ids_raise(self):
        a = TokenToKVPoolAllocator(5)
        ids = a.alloc(2)
        a.free(ids)
        with pytest.raises(ValueError, match="double free"):
            a.free(ids)
        with pytest.raises(ValueError, match="out of range"):
            a.free([0])
        with pytest.raises(ValueError, match="out of range"):
            a.free([6])

    def test_integrity_detects_leak_and_double_ownership(self):
        a = TokenToKVPoolAllocator(8)
        ids = a.alloc(3)
        with pytest.raises(AssertionError, match="leaked"):
            a.check_integrity([])
        with pytest.raises(AssertionError, match="twice"):
            a.check_integrity([ids, ids[:1]])
        a.check_integrity([ids])

    def test_ids_are_unique_across_allocs(self):
        a = TokenToKVPoolAllocator(100)
        chunks = [a.alloc(n) for n in (10, 20, 30)]
        everything = np.concatenate(chunks)
        assert np.unique(everything).size == everything.size, "a slot was handed out twice"


class TestReqToTokenPool:
    def test_rows_alloc_until_exhausted(self):
        p = ReqToTokenPool(2, 16)
        rows = [p.alloc(), p.alloc()]
        assert sorted(rows) == [0, 1]
        assert p.alloc() is None
        p.free(rows[0])
        assert p.available_size() == 1
        p.check_integrity([rows[1]])

    def test_free_zeroes_row_and_rejects_double_free(self):
        p = ReqToTokenPool(1, 4)
        row = p.alloc()
        p.req_to_token[row] = [5, 6, 7, 8]
        p.free(row)
        assert not p.req_to_token[row].any(), "a freed row must not name old slots"
        with pytest.raises(ValueError):
            p.free(row)

    def test_integrity_detects_leaked_row(self):
        p = ReqToTokenPool(3, 4)
        p.alloc()
        with pytest.raises(AssertionError, match="leaked"):
            p.check_integrity([])
