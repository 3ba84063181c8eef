"""The OpenAI-compatible endpoint end to end: Ray Serve LLM with the real vLLM CPU
engine serving SmolLM2 on emulated v6e 2x2 slices (one replica per slice, two
slices), driven by the official ``openai`` client over real HTTP. One fleet and
one deployment for the module."""

from __future__ import annotations

import socket

import pytest

pytest.importorskip("vllm", reason="needs vLLM's CPU build (./run.sh test installs it)")
openai = pytest.importorskip("openai")

from pathways_ray import LocalFleet, Topology  # noqa: E402
from pathways_ray.serve import llm_config, serve_llm, shutdown_llm  # noqa: E402

pytestmark = pytest.mark.slow

MODEL = "smollm2"
MAX_MODEL_LEN = 1024
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def endpoint():
    # Two single-host 2x2 slices serve; a 2x4 slice of two 4-chip hosts checks how Ray
    # Serve LLM reserves a multi-host slice from our TPU config.
    slices = ["v6e-2x2", "v6e-2x2", Topology.parse("v6e", "2x4", chips_per_host=4)]
    with LocalFleet(slices, name="serve-test") as fleet:
        cfg = llm_config(MODEL, topology="2x2", platform="cpu", max_model_len=MAX_MODEL_LEN,
                         num_slices=2)
        url = serve_llm(cfg, port=_free_port(), timeout_s=600)
        try:
            yield fleet, url
        finally:
            shutdown_llm(None)


@pytest.fixture(scope="module")
def client(endpoint):
    return openai.OpenAI(base_url=endpoint[1], api_key="not-needed", timeout=120,
                         max_retries=0)


def _still_serves(client):
    r = client.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=4, temperature=0)
    assert r.choices[0].text and r.usage.completion_tokens == 4


def test_one_replica_per_slice_holding_all_its_chips(endpoint):
    import ray
    from ray.util import placement_group_table

    fleet, _ = endpoint
    pgs = [pg for pg in placement_group_table().values()
           if pg["state"] == "CREATED" and any("TPU-v6e-4-head" in b for b in
                                               pg["bundles"].values())]
    assert len(pgs) == 2, pgs
    labels = {n["NodeID"]: n.get("Labels", {}) for n in ray.nodes()}
    slices = {labels[pg["bundles_to_node_id"][0]]["ray.io/tpu-slice-name"] for pg in pgs}
    two_by_two = {n for n, t in fleet.slice_names().items() if t.name == "2x2"}
    assert slices == two_by_two  # each replica on its own slice
    assert all(pg["bundles"][0]["TPU"] == 4 for pg in pgs)  # every chip of the 2x2 slice


def test_ray_serve_llm_reserves_a_multi_host_slice_whole(endpoint):
    """What a TPU replica's engine gets: Ray Serve LLM's own SlicePlacementGroup,
    made from our config for v6e 2x4 on 4-chip hosts (one bundle per host)."""
    import ray
    from ray.serve.llm import LLMConfig
    from ray.util import placement_group_table

    from pathways_ray.serve import llm_config_dict

    fleet, _ = endpoint
    engine = LLMConfig(**llm_config_dict("m", topology="2x4", chips_per_host=4)
                       ).get_engine_config()
    pg = engine.accelerator.create_placement_group(
        bundles=engine.placement_bundles, strategy="PACK", name="serve-test-2x4",
        accelerator_type_str="TPU-V6E")
    try:
        assert pg.wait(60), "Ray Serve LLM's slice placement group was not placed in 60 s"
        labels = {n["NodeID"]: n.get("Labels", {}) for n in ray.nodes()}
        hosts = [labels[node] for node in placement_group_table(pg)["bundles_to_node_id"]
                 .values()]
        (name,) = [n for n, t in fleet.slice_names().items() if t.name == "2x4"]
        assert {h["ray.io/tpu-slice-name"] for h in hosts} == {name}
        assert sorted(h["ray.io/tpu-worker-id"] for h in hosts) == ["0", "1"]
    finally:
        engine.accelerator.shutdown()


def test_list_models(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_paris_at_temperature_zero(client):
    texts = [client.completions.create(model=MODEL, prompt="The capital of France is",
                                       max_tokens=6, temperature=0).choices[0].text
             for _ in range(2)]
    assert texts[0].startswith(" Paris"), texts
    assert texts[0] == texts[1]  # greedy decoding is deterministic


def test_chat(client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=20,
                                       temperature=0)
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].message.role == "assistant"
    u = r.usage
    assert u.prompt_tokens > 10  # the chat template's system prompt and markers count
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert 1 <= u.completion_tokens <= 20


def test_chat_stream_matches_non_stream(client):
    full = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12,
                                          temperature=0).choices[0].message.content
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12,
                                                 temperature=0, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_completion_stream_with_usage(client):
    chunks = list(client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=0,
        stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text.startswith(" Paris")
    usage = chunks[-1].usage  # the last chunk carries usage and no choices
    assert usage is not None and not chunks[-1].choices
    assert usage.prompt_tokens == 5 and usage.completion_tokens == 5
    assert all(c.usage is None for c in chunks[:-1])


def test_n_max_tokens_and_stop(client):
    r = client.completions.create(model=MODEL, prompt="Once upon a time", n=3, max_tokens=7,
                                  temperature=1.0, seed=1)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert r.usage.completion_tokens <= 3 * 7
    if all(c.finish_reason == "length" for c in r.choices):
        assert r.usage.completion_tokens == 3 * 7
    assert len({c.text for c in r.choices}) > 1  # three samples, not one repeated
    assert all(c.finish_reason in ("length", "stop") for c in r.choices)
    r = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=30,
                                  temperature=0, stop=[","])
    assert r.choices[0].finish_reason == "stop"
    assert "," not in r.choices[0].text
    r = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=3,
                                  temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    assert e.value.status_code == 404
    _still_serves(client)


@pytest.mark.parametrize("kwargs", [
    {"max_tokens": -1},
    {"temperature": -0.5},
    {"prompt": "hello " * (MAX_MODEL_LEN + 50)},  # longer than max_model_len
], ids=["max_tokens=-1", "negative-temperature", "prompt-over-max_model_len"])
def test_bad_requests_are_400(client, kwargs):
    kwargs = {"model": MODEL, "prompt": "hi", "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**kwargs)
    assert e.value.status_code == 400
    _still_serves(client)


def test_bad_chat_request_is_400(client):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=-1)
    _still_serves(client)
