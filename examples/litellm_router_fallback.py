"""``litellm.Router`` falls back to another model when the agentspec verifier is slow or down.

Run it offline on a CPU (about a minute with the real model, most of it loading)::

    python examples/litellm_router_fallback.py            # Qwen2.5-Coder-0.5B-Instruct
    python examples/litellm_router_fallback.py --tiny     # tiny random-weight model (seconds)

The Router has two deployments: ``agent`` (``agentspec/<served-model>`` at a verifier started in-process
on 127.0.0.1) and ``backup`` (a stand-in for a hosted model: litellm's ``mock_response``, so nothing
leaves the machine), with ``fallbacks=[{"agent": ["backup"]}]``. Three calls:

1. the verifier is up: agentspec answers;
2. the verifier is behind a proxy adding 10 s of delay and the call has ``timeout=2``: the provider
   enforces the timeout itself (litellm does not for custom providers), raises ``litellm.Timeout``, and
   the Router falls back;
3. the verifier has been stopped: the provider raises ``litellm.APIConnectionError``; the Router falls back.
"""

from __future__ import annotations

import argparse
import time

from _verifier import add_model_args, in_process_verifier, load_target, served_name

ASK = [{"role": "user", "content": "Say hello in five words."}]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(parser)
    args = parser.parse_args()

    from rich.console import Console

    from agentspec.adapters.litellm import litellm, register
    from benchmarks.delay_proxy import DelayProxy

    console = Console()
    register()
    litellm.suppress_debug_info = True
    target = load_target(args)

    def router(api_base: str, timeout: float) -> litellm.Router:
        return litellm.Router(
            model_list=[
                {"model_name": "agent", "litellm_params": {"model": f"agentspec/{served_name(args)}",
                                                           "api_base": api_base, "timeout": timeout}},
                {"model_name": "backup", "litellm_params": {"model": "openai/gpt-4o-mini", "api_key": "unused",
                                                            "mock_response": "fallback answer from backup"}},
            ],
            fallbacks=[{"agent": ["backup"]}], num_retries=0)

    def ask(label: str, r: litellm.Router) -> None:
        t0 = time.perf_counter()
        resp = r.completion(model="agent", messages=ASK, max_tokens=24)
        deployment = resp._hidden_params.get("custom_llm_provider") or "?"
        console.print(f"[bold]{label}[/] ({time.perf_counter() - t0:.1f} s, answered by {deployment} "
                      f"{resp.model}): {(resp.choices[0].message.content or '').strip()!r}")

    with in_process_verifier(target, served_name(args)) as url:
        ask("1. verifier up", router(url, timeout=300))
        port = int(url.rsplit(":", 1)[1])
        with DelayProxy("127.0.0.1", port, one_way_delay_s=5.0) as proxy:
            ask("2. verifier 10 s away, timeout=2", router(f"http://127.0.0.1:{proxy.port}", timeout=2))
    ask("3. verifier stopped", router(url, timeout=300))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
