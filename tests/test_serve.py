"""The OpenAI-compatible endpoint end to end: Ray Serve LLM with the real vLLM CPU
engine serving SmolLM2 on emulated v6e 2x2 slices (one replica per slice, two
slices), driven by the official ``openai`` client over real HTTP. One fleet and
one deployment for the module; the last tests add a second app (on a v6e 1x1 slice,
which the first app's replicas cannot use) and kill, then restore, a replica's host."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.waiting import wait_until

pytest.importorskip("vllm", reason="needs vLLM's CPU build (./run.sh test installs it)")
openai = pytest.importorskip("openai")

from pathways_ray import LocalFleet, Topology  # noqa: E402
from pathways_ray._procs import free_ports  # noqa: E402
from pathways_ray.serve import llm_config, serve_llm, shutdown_llm  # noqa: E402

pytestmark = pytest.mark.slow

MODEL = "smollm2"
MAX_MODEL_LEN = 1024
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def _free_port() -> int:
    (port,) = free_ports(1)  # not one another test process is about to bind
    return port


@pytest.fixture(scope="module")
def endpoint():
    # Two single-host 2x2 slices serve; a 2x4 slice of two 4-chip hosts checks how Ray
    # Serve LLM reserves a multi-host slice from our TPU config.
    slices = ["v6e-2x2", "v6e-2x2", Topology.parse("v6e", "2x4", chips_per_host=4), "v6e-1x1"]
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
    # The ingress stays off the TPU hosts (it would die with one, and every request too).
    from ray.serve.context import _get_global_client

    details = _get_global_client().get_serve_details()["applications"]["llm"]["deployments"]
    ingress = [r["node_id"] for r in details["FailoverIngress"]["replicas"]]
    assert ingress and not set(ingress) & set(fleet.node_ids.values()), ingress


def test_direct_streaming_makes_the_replica_the_ingress_with_haproxy_retries(endpoint):
    """Ray Serve LLM reads its direct-streaming switch once, at import: fresh processes,
    attached to the fleet (building an app asks Ray for the job's runtime env)."""
    from pathways_ray.serve.app import DIRECT_STREAMING_ENV

    fleet, _ = endpoint
    code = """if True:
        from pathways_ray.serve import llm_config, openai_app
        from pathways_ray.serve.app import direct_streaming
        assert direct_streaming()
        cfg = llm_config("m", topology="2x2", platform="cpu", model_source="/ckpt")
        try:
            print("ingress:", openai_app(cfg)._bound_deployment.name)
        except ValueError as e:
            print("refused:", e)
        print("plain:", openai_app(cfg, failover=False)._bound_deployment.name)
    """

    def run(**env):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env={**os.environ, **fleet.env, **DIRECT_STREAMING_ENV, **env},
                             timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        return out.stdout

    assert "ingress: LLMServer:m" in (out := run()) and "plain: LLMServer:m" in out
    out = run(RAY_SERVE_HAPROXY_RETRY_ON="conn-failure")
    assert "refused: failover=True with Ray Serve LLM's direct streaming" in out
    assert "RAY_SERVE_HAPROXY_RETRY_ON='conn-failure' lacks 'empty-response'" in out
    assert "plain: LLMServer:m" in out


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


def _cli(fleet, *argv) -> str:
    """`pathways-ray ...` in a process of its own, attached to the module's fleet."""
    out = subprocess.run([sys.executable, "-m", "pathways_ray.cli.main", *argv],
                         env={**os.environ, **fleet.env, "COLUMNS": "200"},
                         capture_output=True, text=True,
                         timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def _apps() -> dict:
    from pathways_ray.serve.inventory import served_apps

    return {a.name: a for a in served_apps()}


def _ingress_log(fleet) -> list[str]:
    """The lines the ingress replicas logged (in their node's Ray session logs)."""
    logs = sorted(fleet.dir.glob("*/session_*/logs/serve/replica_llm_FailoverIngress_*"))
    return [line for path in logs for line in path.read_text(errors="replace").splitlines()]


def _wait_until(cond, timeout_s: float, what: str, detail=None):
    return wait_until(cond, timeout_s, what, every_s=1, detail=detail)


def _engine_threads(fleet) -> list[str]:
    """OMP_NUM_THREADS of each vLLM engine worker process of the fleet."""
    import psutil

    from pathways_ray import _procs

    found = []
    for p in _procs.find(fleet.fleet_id):
        try:
            if p.name() == "VLLM::Worker":
                found.append(p.environ().get("OMP_NUM_THREADS"))
        except psutil.Error:
            continue
    return sorted(found)


def test_two_named_apps_answer_at_once_and_deleting_one_keeps_the_other(endpoint, client):
    """A second app ('small': the same weights as another model id, on a 1x1 slice)
    answers under /small/v1 beside the default app; `pathways-ray serve list` shows
    both with the slice of each replica; `serve delete small` deletes only it."""
    from pathways_ray.serve import smollm2_checkpoint

    fleet, url = endpoint
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    small = llm_config("smollm2-1x1", model_source=str(smollm2_checkpoint()), topology="1x1",
                       platform="cpu", max_model_len=MAX_MODEL_LEN)
    url_small = serve_llm(small, name="small", port=port, timeout_s=600)
    assert url_small.endswith("/small/v1")
    other = openai.OpenAI(base_url=url_small, api_key="not-needed", timeout=120,
                          max_retries=0)
    assert [m.id for m in other.models.list().data] == ["smollm2-1x1"]
    # Each engine computes on its app's share of the cores: Ray's own default (1 for
    # a replica, which vLLM keeps) left a lone replica on one core of many.
    cores = len(os.sched_getaffinity(0))
    assert _engine_threads(fleet) == sorted([str(max(1, cores // 2))] * 2 + [str(cores)])

    def ask(c, model):
        return c.completions.create(model=model, prompt="The capital of France is",
                                    max_tokens=6, temperature=0).choices[0].text

    with ThreadPoolExecutor(4) as pool:
        texts = list(pool.map(lambda cm: ask(*cm), [(client, MODEL), (other, "smollm2-1x1")] * 2))
    assert all(t.startswith(" Paris") for t in texts), texts
    (one_by_one,) = [n for n, t in fleet.slice_names().items() if t.name == "1x1"]
    listed = _cli(fleet, "serve", "list")
    assert "small" in listed and "/small" in listed and "smollm2-1x1" in listed
    assert one_by_one in listed and listed.count("serving") == 2, listed
    assert "llm/smollm2 running" in _cli(fleet, "status")  # what each slice serves
    # vLLM's figures, through Ray: a replica's reach its node's metrics endpoint at
    # Ray's next report (every 10 s), so the new app's may not be there yet.
    shown = {}

    def both_models_shown():
        shown["figures"] = _cli(fleet, "serve", "metrics", "--window", "1")
        return all(m in shown["figures"] for m in ("smollm2-1x1", "KV cache", f"{MODEL} "))

    _wait_until(both_models_shown, 60, "`serve metrics` did not show both models",
                detail=lambda: shown["figures"])

    assert "still serving: llm" in _cli(fleet, "serve", "delete", "small")
    assert "small" not in _apps()
    with pytest.raises(openai.NotFoundError):
        ask(other, "smollm2-1x1")
    assert ask(client, MODEL).startswith(" Paris")


def test_losing_a_replica_host_under_load_fails_no_request_and_it_comes_back(endpoint):
    """Steady load (4 clients of short completions, 2 streaming); the host of one
    replica's slice is killed. No non-streaming request fails (those in flight on the
    lost replica are sent again), a stream cut mid-answer ends with an error naming
    the lost replica, never a hang; the app reports itself degraded; once the host is
    restored, Serve starts the replica there again by itself."""
    from pathways_ray.serve.loadgen import Load

    fleet, url = endpoint
    llm = _apps()["llm"]
    assert llm.state == "serving"
    victim = llm.replicas[0].slice
    assert victim and fleet.slice_names()[victim].name == "2x2"
    with Load(url, MODEL, clients=6, streaming=2, max_tokens=16, timeout_s=90) as load:
        time.sleep(4)
        # Kill while every client waits on an answer: Serve balances by requests in
        # flight, so the lost replica holds about half of them, non-streaming ones too.
        _wait_until(lambda: load.in_flight() == 6, 30, "the 6 clients never all waited")
        t_kill = time.monotonic()
        fleet.remove_host(victim, 0)  # returns once Ray marked the node dead
        _wait_until(lambda: _apps()["llm"].state == "degraded", 60,
                    "the app did not report itself degraded")
        time.sleep(4)
    plain = [r for r in load.results if not r.stream]
    assert [r.error for r in plain if r.error] == []
    assert len([r for r in plain if r.sent > t_kill]) >= 4
    resent = [line for line in _ingress_log(fleet) if "sending it again" in line]
    assert resent, "no request was in flight on the lost replica: the test proved nothing"
    for r in load.failed(stream=True):
        assert r.cut and "the replica serving this stream was lost" in r.error, r.error

    fleet.restore_host(victim, 0)
    back = _wait_until(lambda: (a := _apps()["llm"]).state == "serving" and a, 420,
                       "the replica did not come back after its host returned")
    assert victim in {r.slice for r in back.replicas if r.healthy}
    client = openai.OpenAI(base_url=url, api_key="not-needed", timeout=120, max_retries=0)
    for _ in range(4):
        _still_serves(client)
