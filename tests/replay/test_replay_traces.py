"""Trace readers on the tiny fixtures: field mapping, arrival mix, sub-agents, ideal hit rate."""

import pytest

from flatcake.replay.keys import PageKeyer
from flatcake.replay.traces import detect_format, ideal_hit_rate, load_trace, read_mooncake, read_weka
from replay_fixtures import mooncake_path, weka_path  # noqa: F401  (pytest fixtures)


def test_mooncake_reader_maps_fields_in_file_order(mooncake_path):
    reqs = read_mooncake(mooncake_path)
    assert len(reqs) == 5
    assert [r.arrival_s for r in reqs] == [0.0, 0.01, 0.02, 0.03, 0.04]  # ms -> s
    assert reqs[0].block_ids == (0, 1, 2)
    assert reqs[0].block_tokens == 512
    assert reqs[0].prompt_tokens == 1300 and reqs[0].output_tokens == 10
    assert {r.namespace for r in reqs} == {"mooncake:mooncake_5"}  # global ids: one namespace


def test_mooncake_max_requests_stops_early(mooncake_path):
    assert [r.block_ids for r in read_mooncake(mooncake_path, max_requests=2)] == [(0, 1, 2), (0, 1, 3)]


def test_weka_reader_streams_archive_and_interleaves_sessions(weka_path):
    reqs = read_weka(weka_path, session_gap_s=2.0)
    # trace_0001 starts at 0 s, trace_0002 at 2 s; the sub-agent marker is at t=5 (relative t 0, 3)
    assert [(r.arrival_s, r.namespace, r.block_ids) for r in reqs] == [
        (0.0, "weka:trace_0001", (1, 2, 3)),
        (2.0, "weka:trace_0002", (1, 2)),
        (5.0, "weka:trace_0001", (1, 2, 10, 11)),
        (6.0, "weka:trace_0002", (1, 2, 3)),
        (8.0, "weka:trace_0001", (1, 2, 10, 11, 12)),
        (10.0, "weka:trace_0001", (1, 2, 3, 4, 5)),
    ]
    assert [r.subagent for r in reqs] == [False, False, True, False, True, False]
    assert all(r.block_tokens == 64 for r in reqs)
    assert reqs[0].prompt_tokens == 3 * 64 + 7  # `in`


def test_weka_session_limits(weka_path):
    assert {r.namespace for r in read_weka(weka_path, sessions=1)} == {"weka:trace_0001"}
    assert {r.namespace for r in read_weka(weka_path, skip_sessions=1)} == {"weka:trace_0002"}
    # trace_0001's largest prompt is 5 blocks = 320 tokens: filtered out at 256
    assert {r.namespace for r in read_weka(weka_path, max_context_tokens=256)} == {"weka:trace_0002"}
    assert len(read_weka(weka_path, max_requests=4, session_gap_s=2.0)) == 4


def test_format_detection(mooncake_path, weka_path, tmp_path):
    assert detect_format(mooncake_path) == "mooncake"
    assert detect_format(weka_path) == "weka"
    with pytest.raises(ValueError, match="unknown trace format"):
        detect_format(tmp_path / "x.csv")
    assert len(load_trace(weka_path, sessions=2)) == 6


def test_ideal_hit_rate_mooncake_fixture(mooncake_path):
    keys = [PageKeyer(64).keys(r) for r in read_mooncake(mooncake_path)]
    # pages per request: 2,3,1,4,1 whole blocks x 8; hits: 0, 16, 0, 24, 8
    assert [len(k) for k in keys] == [16, 24, 8, 32, 8]
    assert ideal_hit_rate(keys) == (48, 88)


def test_ideal_hit_rate_weka_fixture_ids_are_local_to_a_conversation(weka_path):
    keys = [PageKeyer(64).keys(r) for r in read_weka(weka_path, session_gap_s=2.0)]
    # trace_0002's ids 1,2 do not hit trace_0001's: hits 0,0,2,2,4,3 of 3,2,4,3,5,5
    assert ideal_hit_rate(keys) == (11, 22)
