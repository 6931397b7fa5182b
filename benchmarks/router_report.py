"""Markdown report and plot of ``benchmarks.router`` results (``router.json`` → ``router.md``, ``router.png``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

COLOURS = {"server": "tab:blue", "server-ar": "tab:orange", "edge": "tab:green"}


def _f(x: float | None, digits: int = 1) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def tables(r: dict[str, Any]) -> list[str]:
    """Per target: tokens/s per mode and auto/best, predicted vs measured ms/token, break-even RTTs."""
    drafters = r["meta"]["settings"]["drafters"]
    lines: list[str] = []
    for spec, t in r["targets"].items():
        names = list(t["points"][0]["modes"])
        lines += [f"### {spec}", "", "Decode tokens/s (session open/close excluded; the fastest repetition per "
                  "prompt); `auto/best` = auto ÷ the best fixed mode it could pick (edge with its drafter, server, "
                  "server-ar): the smallest over those modes of auto's tokens/s ÷ the mode's over the same blocks "
                  "(a block: one prompt and repetition, every mode back to back; the base and the extra "
                  "repetitions for a contender, marked *, the base ones for the rest), then the mode it is "
                  "against, the median of the per-block ratios and the same ratio from the fastest "
                  "repetitions; `probes-only` = what auto/best "
                  "would be if auto lost only to ModePolicy's periodic probes of the modes it cannot judge by shadow "
                  "replays (1.000: every mode is shadowed, nothing is probed).", "",
                  "| RTT ms | " + " | ".join(names) + " | " + " | ".join(f"auto/best ({d})" for d in drafters) + " |",
                  "|---" * (1 + len(names) + len(drafters)) + "|"]
        for p in t["points"]:
            lines.append(f"| {p['rtt_ms']:g} | " + " | ".join(_f(p["modes"][n]["tokens_per_s"], 2) for n in names)
                         + " | " + " | ".join(f"{p['auto_vs_best'][d]:.3f} ({_star(p, p['auto_vs_best_paired_against'][d])}, "
                                              f"{_blocks(p, d)} blocks; median of blocks {p['auto_vs_best_median_of_blocks'][d]:.3f}; "
                                              f"fastest reps {p['auto_vs_best_fastest_reps'][d]:.3f} vs "
                                              f"{p['best_fixed'][d]}; probes-only "
                                              f"{p['auto_vs_best_if_only_probes'][d]:.3f})" for d in drafters)
                         + " |")
        fixed = [n for n in names if not n.startswith("auto")]
        lines += ["", "ms/token, measured / predicted by the closed forms (relative error):", "",
                  "| RTT ms | " + " | ".join(fixed) + " |", "|---" * (1 + len(fixed)) + "|"]
        for p in t["points"]:
            lines.append(f"| {p['rtt_ms']:g} | " + " | ".join(
                f"{p['modes'][n]['ms_per_token']:.1f} / {p['modes'][n]['predicted_ms_per_token']:.1f} "
                f"({100 * p['modes'][n]['prediction_rel_error']:.0f}%)" for n in fixed) + " |")
        lines += ["", "Break-even RTT (ms, injected): edge vs server-ar (the paper's edge vs plain decoding) and edge "
                  "vs server mode. Measured: where least-squares lines through the measured ms/token at every RTT "
                  "cross; interpolated: between the two sweep points around the first sign change.", "",
                  "| edge drafter | predicted | measured | rel. error | interpolated | rel. error | "
                  "paper's E[A]·t_ar − γ·t_d − t_v | edge = server: predicted | measured |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for d, b in t["break_even"].items():
            s = b["edge_vs_server"]
            lines.append(f"| {d} | {_f(b['predicted_ms'])} | {_f(b['measured_ms'])} | "
                         f"{_f(None if b['rel_error'] is None else 100 * b['rel_error'], 0)}% | "
                         f"{_f(b['measured_interpolated_ms'])} | "
                         f"{_f(None if b['rel_error_interpolated'] is None else 100 * b['rel_error_interpolated'], 0)}%"
                         " | "
                         f"{_f(b['paper_break_even_rtt_ms'])} | {_f(s['predicted_ms'])} | {_f(s['measured_ms'])} |")
        lines.append("")
    return lines


def write_markdown(r: dict[str, Any], path: Path) -> None:
    m, s, acc = r["meta"], r["meta"]["settings"], r["acceptance"]
    mach = m["machine"]
    lines = ["# agentspec router: latency of each mode against round-trip time", "",
             f"{mach['date_utc']} · {mach['cpu']} ({', '.join(mach['cpu_flags'])}) · {mach['cpu_count']} cores, "
             f"{mach['torch_threads']} torch threads · torch {mach['torch']} · transformers {mach['transformers']} · "
             f"commit {mach['git_commit']} · {m['wall_s'] / 60:.1f} min", "",
             f"Targets {', '.join(s['targets'])}; BFCL v4 tool-calling prompts {', '.join(m['data']['prompt_ids'])} "
             f"(warm-up {m['data']['warmup_prompt_id']}), greedy, {s['max_new_tokens']} new tokens, γ = {s['gamma']} "
             f"draft tokens per round on both sides, segments of {s['segment_tokens']} tokens. Injected RTTs "
             f"{', '.join(f'{x:g}' for x in s['rtts'])} ms through `DelayProxy` on loopback ({m['delay']}); the "
             "verifier runs in-process. Edge drafters: " + "; ".join(f"`{d}` {v}" for d, v in m["edge_drafters"].items())
             + f"; the verifier drafts with {m['server_drafter']} in server mode.", "",
             "## Acceptance", "", "```json", json.dumps(acc, indent=1), "```", "",
             "Thresholds: auto ≥ 0.95 × the best fixed mode at every RTT; measured break-even within 20% of the "
             "predicted one (cases whose predicted or interpolated crossing lies inside the sweep); predicted "
             "ms/token within 25% of measured for every fixed mode and RTT.", "",
             "## Results", ""]
    lines += tables(r)
    lines += ["## Calibration and routing", ""]
    for spec, t in r["targets"].items():
        c = t["calibration"]
        lines += [f"### {spec}", "", f"{t['model']['class']}, {t['model']['params']:,} params, {t['dtype']}; prompts "
                  f"{t['prompt_tokens']} tokens, references {t['reference_tokens']} tokens; t_ar = t_v(1) = "
                  f"{c['t_ar_ms']:.1f} ms; t_v(k) ms: " + ", ".join(f"{k}: {v * 1e3:.1f}" for k, v in
                                                                    c["verify_cost_s"].items())
                  + (" (before the sweep: " + ", ".join(f"{k}: {v * 1e3:.1f}" for k, v in
                                                       c["verify_cost_before_sweep_s"].items()) + ")"
                     if "verify_cost_before_sweep_s" in c else "")
                  + "; per-round loopback overhead ms: " + ", ".join(f"{k} {v:.2f}" for k, v in
                                                                     c["overhead_ms_per_round"].items()), "",
                  "| mode (replay) | rounds | tokens | γ̄ | E[A] | α (fit: E[A](α, γ̄) = E[A]) | accepted/drafted | "
                  "t_d ms/token | mean t_v ms |", "|---|---|---|---|---|---|---|---|---|"]
        for n, x in c["replay"].items():
            lines.append(f"| {n} | {x['rounds']} | {x['tokens']} | {x['gamma']:.2f} | {x['E[A]']:.3f} | {x['alpha']:.3f} "
                         f"| {x['alpha_per_token']:.3f} | {x['t_d'] * 1e3:.3f} | {x['t_v'] * 1e3:.1f} |")
        lines += ["", "auto: tokens per mode it chose (measured requests), and its router's ms/token estimates:", ""]
        for p in t["points"]:
            picks = "; ".join(f"{n}: {p['modes'][n]['tokens_by_mode']} (estimates " + ", ".join(
                f"{k} {v:.1f}" for k, v in p["routers"][n.split(':', 1)[1]]["ms_per_token_estimates"].items()) + ")"
                for n in p["modes"] if n.startswith("auto:"))
            lines.append(f"* RTT {p['rtt_ms']:g} ms — {picks}")
        ll = t["lossless"]
        lines += ["", f"Lossless: {ll['identical_to_plain']}/{ll['runs']} runs identical to plain greedy; identical "
                  f"across modes: {ll['identical_across_modes']}; bf16 ties {ll['tie_divergences']}, real failures "
                  f"{ll['real_failures']}."]
        for d in ll["divergences"]:
            lines.append(f"  * {d['verdict']}: {d['mode']} at RTT {d['rtt_ms']:g} on {d['prompt_id']}, position "
                         f"{d['position']}, margin {d['margin']:.4f} ({d['margin_ulps']:.2f} bf16 ulp)")
        lines.append("")
    lines += ["## Notes", "",
              "* Predictions use `agentspec.router`'s closed forms fed only with the calibration: t_v(k) a line "
              "through the medians per γ of the decode passes the server reported to the fixed modes' clients during "
              "the sweep (server compute only; this VM's speed drifted by 20-30 % between a calibration before the "
              "sweep and the sweep, which mispredicts every point alike: that curve and its predictions are kept in the "
              "JSON as `verify_cost_before_sweep_s` and `predicted_ms_per_token_start_curve`), t_ar = t_v(1), α and γ̄ "
              "from a replay of each mode's round loop over the text that mode decoded (the plain greedy reference, unless a bf16 run diverged from it "
              "at an exact top-2 tie: `replayed_text_equals_plain` in the JSON) (α fitted so that E[A](α, γ̄) equals the replay's tokens per "
              "round: the router's accepted/drafted underestimates E[A] for copy drafters, whose acceptance is "
              "all-or-nothing), draft times measured in the replay, and a per-round loopback overhead measured "
              "at zero added delay on the warm-up prompt. Edge pays the RTT every round, server and server-ar once "
              "per segment.",
              "* Draft lengths are fixed (γ every round, fewer only when the request or segment ends or the n-gram "
              "finds a shorter continuation); `auto` is the stock `ModePolicy` (closed forms fed with online "
              "estimates; E[A] of the n-gram drafters from shadow replays over the committed text; hysteresis) with "
              "that fixed γ for its edge rounds, a fresh one per RTT point, warmed until it has measured every mode.",
              f"* `api` mode is not measured: {m['not_measured']['api']}.", ""]
    path.write_text("\n".join(lines))


def write_plot(r: dict[str, Any], path: Path) -> None:
    """One panel per target × edge drafter: ms/token against RTT, measured (solid) and predicted (dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drafters = r["meta"]["settings"]["drafters"]
    specs = list(r["targets"])
    fig, axes = plt.subplots(len(specs), len(drafters), figsize=(6 * len(drafters), 4.2 * len(specs)),
                             squeeze=False)
    for row, spec in enumerate(specs):
        t = r["targets"][spec]
        rtts = [p["rtt_ms"] for p in t["points"]]
        grid = [min(rtts) + (max(rtts) - min(rtts)) * i / 200 for i in range(201)]
        for col, d in enumerate(drafters):
            ax = axes[row][col]
            for name, colour in ((f"edge:{d}", COLOURS["edge"]), ("server", COLOURS["server"]),
                                 ("server-ar", COLOURS["server-ar"])):
                ax.plot(rtts, [p["modes"][name]["ms_per_token"] for p in t["points"]], "o-", color=colour,
                        label=f"{name} measured")
                line = t["calibration"]["lines"][name]  # the closed form is linear in RTT: draw it densely
                ax.plot(grid, [line["ms_per_token_at_0"] + line["ms_per_token_per_ms_rtt"] * x for x in grid], "--",
                        color=colour, alpha=0.7, label=f"{name} predicted")
            ax.plot(rtts, [p["modes"][f"auto:{d}"]["ms_per_token"] for p in t["points"]], "s-", color="black",
                    linewidth=2.5, zorder=5, label="auto")
            b = t["break_even"][d]
            for x, style in ((b["predicted_ms"], ":"), (b["measured_ms"], "-.")):
                if x is not None and min(rtts) <= x <= max(rtts):
                    ax.axvline(x, color="grey", linestyle=style, linewidth=1)
            ax.set_xscale("symlog", linthresh=10)
            ax.set_yscale("log")
            ax.set_xlim(min(rtts), max(rtts) * 1.05)
            ax.set_xlabel("injected RTT, ms (dotted: predicted break-even, dash-dot: measured)")
            ax.set_ylabel("decode ms / token")
            ax.set_title(f"{spec} · edge drafter {d}", fontsize=10)
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _star(point: dict, mode: str) -> str:
    """``mode``, with * when it was a contender (it ran the extra repetitions)."""
    return mode + ("*" if mode in point.get("contenders", ()) else "")


def _blocks(point: dict, drafter: str) -> int:
    """Blocks behind auto/best's paired median."""
    against = point["auto_vs_best_paired_against"][drafter]
    return point["auto_vs_fixed_paired"][drafter][against].get("blocks", 0)
