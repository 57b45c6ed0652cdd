"""Prefill/decode disaggregation end to end with real vLLM engines: a prefill and a decode
engine of vLLM's CPU build with the NixlConnector (NIXL over UCX on loopback), the router in
front of them. Opt-in (`TRIO_ROUTER_REAL_PD=run`): NIXL adds a quarter of a gigabyte to the
engine environment and each idle NIXL engine keeps a core busy, more than the CI budget of
the real tier allows."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from functools import partial
from typing import Any, Final

import httpx
import pytest
import trio

from trio_router import server
from trio_router.config import (
    Config,
    DisaggregationConfig,
    DiscoveryConfig,
    ProbeConfig,
    ProxyConfig,
    RoutingConfig,
    ServerConfig,
    StaticConfig,
    StaticEngine,
    StatsConfig,
)
from trio_router.table import RoutingTable
from trio_router.testing import vllm_engines
from trio_router.testing._vllm_model import WORDS
from trio_router.testing.harness import CHAT, sample
from trio_router.testing.vllm_engines import MODEL_NAME, EngineProcess, EngineSpec

pytestmark = pytest.mark.real_pd

LIMIT: Final = 120.0
HOSTS: Final = ("127.0.1.51", "127.0.1.52")  # prefill, decode
SIDE_CHANNEL_PORT: Final = 5600  # NIXL's handshake port; the same on both, distinct IPs


@pytest.fixture(scope="module")
def pd_engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[EngineProcess]]:
    if os.environ.get("TRIO_ROUTER_REAL_PD") != "run":
        pytest.skip("opt-in: TRIO_ROUTER_REAL_PD=run (real NIXL prefill/decode engines)")
    env = vllm_engines.ensure_environment(log=print, nixl=True)
    (port,) = vllm_engines.free_ports(list(HOSTS), 1)
    specs = [
        EngineSpec(
            host=host,
            port=port,
            core=core,
            kv_cache_bytes=16 << 20,
            block_size=32,
            max_num_seqs=8,
            extra_args=(
                "--kv-transfer-config",
                json.dumps(
                    {"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu"}
                ),
            ),
            extra_env=(
                ("VLLM_NIXL_SIDE_CHANNEL_HOST", host),
                ("VLLM_NIXL_SIDE_CHANNEL_PORT", str(SIDE_CHANNEL_PORT)),
                ("UCX_NET_DEVICES", "lo"),  # NIXL's transfers stay on loopback
            ),
        )
        for core, (host, role) in enumerate(zip(HOSTS, ("kv_producer", "kv_consumer"), strict=True))
    ]
    with vllm_engines.running_engines(
        env, specs, log_dir=tmp_path_factory.mktemp("vllm-pd-logs")
    ) as engines:
        yield engines


async def transferred(client: httpx.AsyncClient, engine: EngineProcess) -> float:
    """Prompt tokens the engine read from another engine instead of computing them."""
    text = (await client.get(f"{engine.url}/metrics")).text
    return sample(
        text,
        "vllm:prompt_tokens_by_source_total",
        engine="0",
        model_name=MODEL_NAME,
        source="external_kv_transfer",
    )


def chat(words: int, **extra: Any) -> dict[str, Any]:
    text = " ".join(WORDS[i % len(WORDS)] for i in range(words))  # one token each
    return {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 8,
        **extra,
    }


async def test_a_streamed_request_is_prefilled_on_one_engine_and_decoded_from_its_cache(
    pd_engines: list[EngineProcess],
) -> None:
    prefill, decode = pd_engines
    config = Config(
        server=ServerConfig(bind="127.0.0.1:0", drain_s=1.0),
        discovery=DiscoveryConfig(
            mode="static",
            static=StaticConfig.from_urls(
                [
                    StaticEngine(url=prefill.url, role="prefill"),
                    StaticEngine(url=decode.url, role="decode"),
                ]
            ),
        ),
        probe=ProbeConfig(interval_s=60.0),
        stats=StatsConfig(interval_s=0.0),
        routing=RoutingConfig(policy="round_robin"),
        disaggregation=DisaggregationConfig(enabled=True),
        proxy=ProxyConfig(stall_floor_s=10.0),  # 2 shared cores: seconds-long gaps
    )
    table = RoutingTable()
    with trio.fail_after(LIMIT):
        async with trio.open_nursery() as nursery, httpx.AsyncClient(timeout=LIMIT) as client:
            (url,) = await nursery.start(
                partial(server.run, config, table=table, handle_signals=False)
            )
            while len(table.routable(MODEL_NAME)) < 2:
                await table.wait_changed()
            before = await transferred(client, decode)
            request = chat(400, stream=True, stream_options={"include_usage": True})
            async with client.stream("POST", f"{url}{CHAT}", json=request) as answer:
                events = [line async for line in answer.aiter_lines() if line]
                headers = answer.headers
            after = await transferred(client, decode)
            whole = await client.post(f"{url}{CHAT}", json=chat(400))
            text = (await client.get(f"{url}/metrics")).text
            nursery.cancel_scope.cancel()
    assert answer.status_code == 200 and events[-1] == "data: [DONE]"
    usage = json.loads(events[-2].removeprefix("data: "))["usage"]
    assert headers["x-trio-router-engine"] == decode.url.removeprefix("http://")
    assert headers["x-trio-router-prefill-engine"] == prefill.url.removeprefix("http://")
    # The decode engine read the prompt's KV cache from the prefill engine (all of it but
    # the last, partial block, which it computes) instead of prefilling it.
    assert after - before >= usage["prompt_tokens"] - 32
    assert whole.status_code == 200 and whole.json()["choices"][0]["message"]["content"]
    assert sample(text, "trio_router_pd_decisions_total", route="disaggregated", reason="") == 2
    assert sample(text, "trio_router_pd_fallbacks_total", reason="missing_params") == 0
