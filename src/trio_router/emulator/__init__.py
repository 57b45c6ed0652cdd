"""An emulated vLLM engine and fleet: vLLM V1's scheduler and prefix cache, a GPU's timing
from a profile, deterministic tokens, and vLLM's HTTP surface, on Trio's clock (scaled, or
Trio's MockClock in tests). A module each:

- `request`: a request inside the engine; `kv_cache`: the block pool and prefix cache;
  `scheduler`: the engine core's scheduler, one step at a time (pure, no clock).
- `profiles`: a step's duration on some hardware (TOML files, shipped in `profiles/`);
  `references`: the published measurements a profile reproduces, replayed on an engine.
- `front_end`: the API server's own work before the engine core has a request and before
  readers have a step's tokens (a profile's optional `[front_end]`).
- `lora`: LoRA adapters (`--lora-modules`, `max_loras`, the runtime load and unload).
- `tokens`: the deterministic tokenizer, chat template and next-token function.
- `engine`: one engine on Trio's clock (`EmulatedEngine.run` steps it); `metrics`: its
  counters and GET /metrics in vLLM's format.
- `kv_events`: vLLM's KV-cache events and `--kv-events-config`; `kv_publisher`: one
  engine's events over ZMQ (PUB, and the replay ROUTER socket).
- `openai_api`: vLLM's request and answer shapes (no I/O); `app`: the ASGI app of one
  engine and `serve_engine`; `http_server`: the engines' own lean HTTP/1.1 server.
- `faults`: one engine's injected fault (hang, slow, 5xx).
- `fleet`: many engines in one process, each in its own cancel scope (`open_fleet`; kill and
  restart); `control`: the fault-injection API over a fleet; `command`: the
  `trio-router emulate` command.

docs/emulator.md says what each reproduces of vLLM, where it departs, and what is not yet done.
"""
