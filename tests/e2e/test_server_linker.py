"""FlatCake as SGLang 0.5.23's direct L3 linker (``FlatCakeLinker``) inside a real SGLang server on
the CPU engine: ``UnifiedRadixCache`` with ``--enable-unified-cache-external-linker``, no HiCache,
no host tier; loads land in the device pool layer by layer (``docs/real-server.md``, "The direct
linker server").

Both tests run in ``make e2e`` (``FLATCAKE_E2E=all``; marked ``e2e_full``): one server lifetime
alone takes 70-90 s on the shared 2-core machine, too long for ``make test``.

The first: a server started through ``flatcake-sglang --direct`` computes a
prompt, ``/flush_cache`` drops the device tree, and the same prompt is restored by the linker with
the tokens of the first run and of a ``transformers`` reference; a second server (SGLang's own
linker flags) on the same pool, after SGLang killed the first one's scheduler (``close()`` never
ran), restores it again. SGLang 0.5.23 counts a linker hit as ``host`` in
``cached_tokens_details`` (:func:`e2e_kit.assert_from_linker`).

The second: offloads placed by the request's ``session_id`` (SGLang's top-level
``GenerateReqInput.session_id`` reaches ``InsertParams.session_id`` and the linker's
``offload(session_id=...)``), read back from the pool; then one page's layer 1 corrupted on disk:
the request that loads it is aborted, a request computed beside it and a later restore succeed.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from e2e_kit import assert_from_linker, full_page_tokens, open_linker_offline, page_keys
from flatcake.gva.address import OFFSET_MASK
from flatcake.testing.reference import greedy
from flatcake.testing.server import REQUEST_TIMEOUT_S, ServerSpec, flatcake_linker
from flatcake.testing.tiny_model import prompt_ids

PAGE = 16

pytestmark = pytest.mark.e2e_full


def test_linker_server_restores_a_flushed_prompt_and_a_restart_restores_it_from_flatcake(tiny_llama, tmp_path,
                                                                                         servers):
    pool = tmp_path / "pool"
    linker = flatcake_linker(pool, **{"ssd.write_backlog_bytes": 0})  # synchronous SSD writes: durable at put
    ids = prompt_ids(700, seed=1)
    expected = greedy(tiny_llama, ids, 16)
    stored = full_page_tokens(len(ids), PAGE)  # 688 tokens: 43 pages of 16

    server = servers(ServerSpec(model_path=tiny_llama, page_size=PAGE, hicache=False, linker=linker, launcher=True),
                     tmp_path, "direct")
    log = server.log_text()
    assert "flatcake-sglang: direct L3 linker (FlatCakeLinker); environment FLATCAKE_PLUGIN=off" in log
    assert "flatcake linker: MHA, 2 layers, page 16 tokens, own store (single)" in log

    first = server.generate(ids)
    assert first.output_ids == expected
    assert first.cached_tokens == 0, first.meta
    server.flush()  # the tree's reset waits for the linker's queued offloads (FlatCakeLinker.reset)
    again = server.generate(ids)
    assert_from_linker(again, PAGE, expected, "after /flush_cache")
    server.stop()

    restarted = servers(ServerSpec(model_path=tiny_llama, page_size=PAGE, hicache=False, linker=linker),
                        tmp_path, "restarted")
    after = restarted.generate(ids)
    assert_from_linker(after, PAGE, expected, "first request of a restarted server")


def _generate_raw(server, ids, session_id=None) -> dict:
    payload = {"input_ids": list(ids), "sampling_params": {"max_new_tokens": 16, "temperature": 0.0,
                                                          "ignore_eos": True}}
    if session_id is not None:
        payload["session_id"] = session_id
    r = requests.post(server.url + "/generate", json=payload, timeout=REQUEST_TIMEOUT_S)
    return {"status": r.status_code, "body": r.json() if r.headers.get("content-type", "").startswith(
        "application/json") else r.text}


def _aborted(answer: dict) -> bool:
    if answer["status"] != 200:
        return True
    return (answer["body"]["meta_info"].get("finish_reason") or {}).get("type") == "abort"


def test_linker_places_offloads_by_session_id_and_a_failed_layer_aborts_only_its_request(tiny_llama, tmp_path,
                                                                                       servers):
    pool = tmp_path / "pool"
    # every page on SSD (no DRAM medium) and written at put, so the stopped server's pool holds them all
    linker = flatcake_linker(pool, **{"dram.capacity_bytes": 0, "ssd.write_backlog_bytes": 0})
    spec = ServerSpec(model_path=tiny_llama, page_size=PAGE, hicache=False, linker=linker)
    server = servers(spec, tmp_path, "sessions")

    # two sessions interleaved, two turns each; a third conversation without a session id
    turns = {}
    for name, seed in (("a", 11), ("b", 12), ("c", 13)):
        turns[name] = [prompt_ids(300, seed=seed)]
    outs = {}
    for turn in range(2):
        for name in ("a", "b", "c"):
            ids = turns[name][turn]
            g = server.generate(ids, session_id=None if name == "c" else f"session-{name}")
            assert g.output_ids == greedy(tiny_llama, ids, 16), name
            outs.setdefault(name, []).append(g.output_ids)
            if turn == 0:
                turns[name].append(ids + g.output_ids + prompt_ids(200, seed=seed + 100))
    server.flush()  # waits for the queued offloads
    server.stop()

    offline = open_linker_offline(tiny_llama, linker, PAGE)
    try:
        store = offline.store
        scopes = {}
        for name in ("a", "b", "c"):
            t1, t2 = page_keys(turns[name][0], PAGE), page_keys(turns[name][1], PAGE)
            assert t2[:len(t1)] == t1  # turn 2 extends turn 1
            infos = [store.page_info(k) for k in t2]
            assert all(i is not None and i.medium == "ssd" for i in infos), name
            scopes[name] = ({i.scope_id for i in infos[:len(t1)]}, {i.scope_id for i in infos[len(t1):]})
        # a session's two turns share one scope; the two interleaved sessions stay apart
        assert len(scopes["a"][0]) == 1 and scopes["a"][0] == scopes["a"][1], scopes
        assert len(scopes["b"][0]) == 1 and scopes["b"][0] == scopes["b"][1], scopes
        assert scopes["a"][0] != scopes["b"][0]
        # without a session id the turn-2 offload is placed by its own key chain: a new scope
        assert scopes["c"][0].isdisjoint(scopes["c"][1]), scopes

        # corrupt one byte of layer 1 of session b's turn-1 page 3: its checksum no longer matches
        e = store.index.get(page_keys(turns["b"][0], PAGE)[3])
        path = store.ssd.path_of((e.gva & OFFSET_MASK) // store.ssd.file_bytes)
        with open(path, "r+b") as f:
            f.seek((e.gva & OFFSET_MASK) % store.ssd.file_bytes + 1 * e.layer_stride + 5)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0xFF]))
    finally:
        offline.close()

    server = servers(spec, tmp_path, "faulted")
    fresh = prompt_ids(300, seed=99)
    with ThreadPoolExecutor(2) as pool_x:  # the failing load and a computed request side by side
        failing = pool_x.submit(_generate_raw, server, turns["b"][0])
        computed = pool_x.submit(server.generate, fresh)
        failed_answer, fresh_answer = failing.result(), computed.result()
    assert _aborted(failed_answer), failed_answer
    assert fresh_answer.output_ids == greedy(tiny_llama, fresh, 16)
    assert "External linker load failed; aborting 1 request(s)" in server.log_text()
    # session a's pages were not touched: restored by the linker, reference tokens
    a1 = server.generate(turns["a"][0])
    assert_from_linker(a1, PAGE, outs["a"][0], "session a after b's failed load")
    # b's failed round is a miss from now on: computed again, reference tokens
    b1 = server.generate(turns["b"][0])
    assert b1.output_ids == outs["b"][0]
    assert b1.host_tokens < full_page_tokens(len(turns["b"][0]), PAGE), b1.meta
