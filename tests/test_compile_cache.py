"""The compilation cache's status and clear: pure file logic, milliseconds."""

from __future__ import annotations

import json

import pytest

from pathways_ray.cli.main import main
from pathways_ray.programs import compile_cache
from pathways_ray.programs.compile_cache import HITS_EVENT, REQUESTS_EVENT, SAVED_EVENT, CacheCounts


def _fake_cache(root):
    root.mkdir(exist_ok=True)
    (root / "jit_step-aa11-cache").write_bytes(b"x" * 100)
    (root / "jit_step-aa11-atime").write_bytes(b"t" * 8)
    (root / "jit_step-bb22-cache").write_bytes(b"x" * 50)
    (root / "jit_call-cc33-cache").write_bytes(b"x" * 10)
    (root / "README").write_text("not ours")
    counters = root / compile_cache.COUNTERS
    counters.mkdir()
    (counters / "s0-0-1.json").write_text(json.dumps({"requests": 3, "hits": 2, "saved_s": 1.5}))
    (counters / "s0-1-2.json").write_text(json.dumps({"requests": 3, "hits": 3}))
    (counters / "s0-2-3.json").write_text("{half written")


def test_summary_counts_entries_bytes_programs_and_lookups(tmp_path):
    _fake_cache(tmp_path / "c")
    s = compile_cache.summary(tmp_path / "c")
    assert (s.entries, s.bytes) == (3, 168)
    assert s.programs == {"jit_step": 2, "jit_call": 1}
    assert s.counts == CacheCounts(requests=6, hits=5, saved_s=1.5) and s.counts.misses == 1
    assert s.processes == 2  # the half-written file is skipped
    table = s.table()
    assert "entries 3" in table and "5 hits, 1 misses" in table and "jit_step" in table


def test_clear_removes_entries_and_counts_and_nothing_else(tmp_path):
    _fake_cache(tmp_path / "c")
    assert compile_cache.clear(tmp_path / "c") == 3
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == [".counters", "README"]
    s = compile_cache.summary(tmp_path / "c")
    assert (s.entries, s.bytes, s.processes) == (0, 0, 0)


def test_a_missing_directory_is_an_empty_cache_and_bad_paths_say_why(tmp_path):
    assert compile_cache.summary(tmp_path / "never").entries == 0
    assert compile_cache.clear(tmp_path / "never") == 0
    (tmp_path / "f").write_text("")
    with pytest.raises(ValueError, match=r"path=.*f' is a file"):
        compile_cache.summary(tmp_path / "f")
    with pytest.raises(ValueError, match=r"gs://b/c.*gcloud storage"):
        compile_cache.clear("gs://b/c")


def test_counter_follows_jax_events_and_restarts_after_a_clear(tmp_path):
    file = tmp_path / compile_cache.COUNTERS / "w.json"
    c = compile_cache._Counter(file)
    for name in (REQUESTS_EVENT, REQUESTS_EVENT, HITS_EVENT, "/jax/other"):
        c.event(name)
    c.duration(SAVED_EVENT, 2.0)
    c.duration("/jax/other_sec", 9.0)
    assert c.counts == CacheCounts(requests=2, hits=1, saved_s=2.0)
    assert json.loads(file.read_text()) == {"requests": 2, "hits": 1, "misses": 1,
                                            "saved_s": 2.0}
    compile_cache.clear(tmp_path)
    c.event(REQUESTS_EVENT)
    assert c.counts.requests == 3  # the process's own total
    assert json.loads(file.read_text())["requests"] == 1  # what status shows: since the clear


def test_cli_cache_status_and_clear(tmp_path, capsys):
    _fake_cache(tmp_path / "c")
    assert main(["cache", "status", "--dir", str(tmp_path / "c")]) == 0
    assert "entries 3" in capsys.readouterr().out
    assert main(["cache", "clear", "--dir", str(tmp_path / "c")]) == 0
    assert "removed 3 entries" in capsys.readouterr().out
