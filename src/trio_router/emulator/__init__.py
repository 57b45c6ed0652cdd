"""An emulated vLLM engine and fleet: vLLM V1's scheduler and prefix cache, a GPU's timing
from a profile, deterministic tokens, and vLLM's HTTP surface, on Trio's clock (scaled, or
Trio's MockClock in tests). A module each:

- `request`: a request inside the engine; `kv_cache`: the block pool and prefix cache;
  `scheduler`: the engine core's scheduler, one step at a time (pure, no clock).
- `profiles`: a step's duration on some hardware (TOML files, shipped in `profiles/`).
- `tokens`: the deterministic tokenizer, chat template and next-token function.
- `engine`: one engine on Trio's clock (`EmulatedEngine.run` steps it); `metrics`: its
  counters and GET /metrics in vLLM's format.
"""
