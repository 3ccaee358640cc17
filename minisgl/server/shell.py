"""`python -m minisgl.serve --shell`: chat with the model in the terminal, answers streamed.

The history is sent whole each turn; the prefix cache makes that cheap. /reset clears it,
/exit (or Ctrl-D) quits, Ctrl-C stops the answer being written.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import threading
from typing import Any

from minisgl.message import TokenizeMsg
from minisgl.server.frontend import Frontend
from minisgl.server.serving import build_sampling

SHELL_SAMPLING = build_sampling({"temperature": 0.7, "top_p": 0.9})


class _LineReader:
    """prompt_toolkit on a terminal (editing, history); plain lines from a pipe otherwise,
    read on a daemon thread so a blocked read never holds up exit."""

    def __init__(self) -> None:
        self.session: Any = None
        if sys.stdin.isatty():
            from prompt_toolkit import PromptSession

            self.session = PromptSession()
        else:
            loop = asyncio.get_running_loop()
            self.lines: asyncio.Queue[str | None] = asyncio.Queue()

            def pump() -> None:
                for line in sys.stdin:
                    loop.call_soon_threadsafe(self.lines.put_nowait, line.rstrip("\n"))
                loop.call_soon_threadsafe(self.lines.put_nowait, None)

            threading.Thread(target=pump, daemon=True).start()

    async def read(self, prompt: str) -> str | None:
        """A line, or None at end of input."""
        if self.session is None:
            print(prompt, end="", flush=True)
            return await self.lines.get()
        while True:
            try:
                return await self.session.prompt_async(prompt)
            except KeyboardInterrupt:
                continue  # Ctrl-C at the prompt clears the line
            except EOFError:
                return None


async def _answer(frontend: Frontend, history: list[dict[str, str]]) -> str | None:
    """Streams one answer to stdout; None when the request failed."""
    loop = asyncio.get_running_loop()
    interrupted = asyncio.Event()
    loop.add_signal_handler(signal.SIGINT, interrupted.set)
    handle = frontend.submit(
        [
            TokenizeMsg(
                frontend.new_uids(1), messages=list(history), sampling=dict(SHELL_SAMPLING), prompt_field="messages"
            )
        ]
    )
    parts: list[str] = []
    try:
        while not handle.done or not handle.queue.empty():
            get = asyncio.ensure_future(frontend.next_reply(handle))
            stop = asyncio.ensure_future(interrupted.wait())
            done, _ = await asyncio.wait({get, stop}, return_when=asyncio.FIRST_COMPLETED)
            if get not in done:
                get.cancel()
                frontend.abort(handle)
                print(" [stopped]")
                return "".join(parts)
            stop.cancel()
            reply = get.result()
            if reply.error is not None:
                print(f"error: {reply.error}" + (" (try /reset)" if reply.error_param else ""))
                return None
            parts.append(reply.text)
            print(reply.text, end="", flush=True)
        print()
        return "".join(parts)
    finally:
        loop.remove_signal_handler(signal.SIGINT)
        if not handle.done:
            frontend.abort(handle)


async def run_shell(frontend: Frontend, model_name: str) -> None:
    reader = _LineReader()
    print(f"minisgl shell: chatting with {model_name}. /reset clears the history, /exit quits.", flush=True)
    history: list[dict[str, str]] = []
    while True:
        line = await reader.read("> ")
        if line is None or line.strip() == "/exit":
            return
        cmd = line.strip()
        if not cmd:
            continue
        if cmd == "/reset":
            history.clear()
            print("(history cleared)")
            continue
        if cmd.startswith("/"):
            print("commands: /reset, /exit")
            continue
        history.append({"role": "user", "content": line})
        answer = await _answer(frontend, history)
        if answer is None:
            history.pop()
        else:
            history.append({"role": "assistant", "content": answer})
