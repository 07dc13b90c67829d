"""Event text is shown as text: log lines full of brackets never reach Rich's markup parser."""

from __future__ import annotations

import asyncio

from tui_support import widget_text, write_run

from appliance.tui.app import make_app

GLOO_LINE = "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:152] timed out connecting [bold]"


def test_failure_reason_stage_name_and_sources_with_brackets_render_verbatim(tmp_path):
    t = 1_800_000_000.0
    events = [
        {"t": t, "kind": "run", "state": "started"},
        {"t": t + 1, "kind": "stage", "name": "[prep]", "state": "started", "progress": 0.0},
        {"t": t + 2, "kind": "failure", "rank": 1, "reason": GLOO_LINE},
        {"t": t + 3, "kind": "stage", "name": "[prep]", "state": "failed", "progress": 0.1, "error": GLOO_LINE},
        {"t": t + 4, "kind": "eval", "step": 1, "valid_loss": 2.0, "per_source": {"[/x]": 1.5}},
        {"t": t + 5, "kind": "run", "state": "failed", "reason": GLOO_LINE},
    ]
    run_dir = write_run(tmp_path, events)

    async def main() -> None:
        app = make_app(run_dir.root, follow=False, poll_interval=0.05)
        async with app.run_test(size=(200, 60)) as pilot:
            for _ in range(100):
                if app.reads_done >= 1:
                    break
                await pilot.pause(0.02)
            await pilot.pause(0.2)
            screen_text = "\n".join(widget_text(w, width=200) for w in app.screen.query("Panel"))
            assert "pair.cc:152" in screen_text
            assert "[prep]" in screen_text

    asyncio.run(main())
