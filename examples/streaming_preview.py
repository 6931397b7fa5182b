"""Streaming with preview tokens: draft text shown greyed out at once, then replaced by the verified text.

Run it offline on a CPU (a minute or two with the real model, most of it loading)::

    python examples/streaming_preview.py                # Qwen2.5-Coder-0.5B-Instruct, 40 ms RTT
    python examples/streaming_preview.py --rtt-ms 150   # a slower network: previews matter more
    python examples/streaming_preview.py --tiny         # tiny random-weight model: plumbing only (seconds)

It starts agentspec-verifier in-process on 127.0.0.1 behind a delaying TCP proxy (a simulated network
round trip), and streams one answer with ``SpecClient(mode="edge", preview=True)``: the client drafts
locally (n-gram copy from the prompt), yields a ``PreviewEvent`` with the draft's text before sending it
for verification, then ``TextEvent``s with what the target verified. In a terminal the preview is drawn
dim after the verified text and replaced each round; piped output prints one line per event instead.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time

from _verifier import add_model_args, in_process_verifier, load_target, served_name

CONFIG = json.dumps({"service": "checkout", "replicas": 3, "debug": False, "regions": ["eu-west-1", "us-east-1"],
                     "timeouts": {"connect_ms": 500, "read_ms": 3000}, "owners": ["payments-team", "sre"]}, indent=2)
# The answer repeats most of the prompt, so the local n-gram drafter has long spans to copy (and preview).
TASK = f"Here is a JSON config:\n```json\n{CONFIG}\n```\nReturn the same JSON with \"debug\" set to true, and nothing else."


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(parser)
    parser.add_argument("--rtt-ms", type=float, default=40.0, help="simulated network round trip")
    parser.add_argument("--num-draft-tokens", type=int, default=8)
    args = parser.parse_args()

    from rich.console import Console
    from rich.live import Live
    from rich.text import Text

    from agentspec.client import FinalEvent, PreviewEvent, SpecClient, TextEvent, ToolCallEvent
    from agentspec.drafters import NgramDrafter
    from benchmarks.delay_proxy import DelayProxy

    console = Console()
    target = load_target(args)
    with in_process_verifier(target, served_name(args)) as url:
        port = int(url.rsplit(":", 1)[1])
        with DelayProxy("127.0.0.1", port, one_way_delay_s=args.rtt_ms / 2e3) as proxy:
            client = SpecClient(f"http://127.0.0.1:{proxy.port}", drafter=NgramDrafter(max_ngram=3),
                                tokenizer=target.tokenizer, mode="edge", preview=True,
                                num_draft_tokens=args.num_draft_tokens, timeout=300)
            console.print(f"[bold]user:[/] {TASK}\n[dim]simulated RTT {args.rtt_ms:.0f} ms; dim = draft, "
                          "not yet verified[/]")
            verified, preview, previews, final = "", "", 0, None
            t0 = time.perf_counter()
            live = Live(Text(), console=console, auto_refresh=False) if console.is_terminal else None
            with live if live is not None else contextlib.nullcontext():
                for ev in client.stream([{"role": "user", "content": TASK}], max_tokens=160):
                    if isinstance(ev, PreviewEvent):
                        preview, previews = ev.text, previews + 1
                    elif isinstance(ev, TextEvent):
                        verified, preview = verified + ev.text, ""
                    elif isinstance(ev, ToolCallEvent):
                        verified, preview = verified + f"\n[tool call {ev.name}({ev.arguments})]", ""
                    elif isinstance(ev, FinalEvent):
                        final = ev
                    if live is not None:
                        text = Text(verified)
                        text.append(preview, style="dim italic")
                        live.update(text, refresh=True)
                    elif not isinstance(ev, FinalEvent):
                        kind = "preview " if isinstance(ev, PreviewEvent) else "verified"
                        console.print(f"{kind} {getattr(ev, 'text', '')!r}", highlight=False)
            client.close()
    assert final is not None
    wall = time.perf_counter() - t0
    stats = final.stats
    console.print(f"\n[bold]answer:[/] {final.text.strip()}")
    console.print(f"{final.usage['completion_tokens']} tokens in {wall:.1f} s; {previews} previews; "
                  f"drafted {stats.drafted}, accepted {stats.accepted} "
                  f"({stats.accepted / max(stats.drafted, 1):.0%}); mean tokens per round "
                  f"{stats.mean_accepted_length:.2f}; finish={final.finish_reason}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
